"""bench/gpu_smoke.sh without a GPU: it stops at once, loudly; and its control flow and table,
with stand-ins for nvidia-smi and Python that say two GPUs are there and pass every command."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_smoke.sh"
NO_GPU = "no CUDA GPU visible: nvidia-smi/torch.cuda.device_count() = 0"


def _run(env: dict, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, cwd=REPO)


def _stub(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)
    return path


def _run_with(tmp_path: Path, nvidia_smi: str, python: str) -> subprocess.CompletedProcess:
    """The script with stand-ins for nvidia-smi (on PATH) and Python (PYTHON): shell bodies."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    _stub(bin_, "nvidia-smi", nvidia_smi)
    return _run({"PATH": f"{bin_}:{os.environ['PATH']}", "PYTHON": str(_stub(tmp_path, "python", python))},
                tmp_path / "out")


def _rows(stdout: str) -> dict[str, list[str]]:
    """The final table: check name -> its cells."""
    return {line.split("|")[0].strip(): [c.strip() for c in line.split("|")]
            for line in stdout.splitlines() if line.count("|") >= 4}


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_without_a_gpu_it_fails_at_once_with_a_clear_message(tmp_path):
    result = _run({"PATH": os.environ["PATH"]}, tmp_path / "out")
    assert result.returncode == 2
    assert NO_GPU in result.stderr
    assert "no nvidia-smi" in result.stderr
    assert not (tmp_path / "out").exists()  # nothing ran


def test_nvidia_smi_without_a_gpu_torch_sees_fails_too(tmp_path):
    # torch.cuda.device_count() = 0 (a CPU-only torch)
    result = _run_with(tmp_path, 'echo "GPU 0: NVIDIA H100 (UUID: GPU-x)"\n', "echo 0\n")
    assert result.returncode == 2
    assert NO_GPU in result.stderr and "nvidia-smi -L lists 1 GPU(s)" in result.stderr


def test_the_table_lists_every_check_including_those_needing_more_gpus(tmp_path):
    result = _run_with(tmp_path, """case "$*" in
  -L) echo "GPU 0: H100"; echo "GPU 1: H100" ;;
  *name,memory.total*) echo "H100, 81559 MiB"; echo "H100, 81559 MiB" ;;
  *memory.used*) echo 1000; echo 2345 ;;
esac
""", """case "$*" in
  *device_count*) echo 2 ;;
  *) exit 0 ;;
esac
""")  # two GPUs; every command passes
    assert result.returncode == 0, result.stderr
    rows = _rows(result.stdout)
    for name in ("trainer-bf16", "trainer-fp16", "stages-gpu", "disaggregated", "colocated", "shared-async",
                 "stages-one-gpu", "stages", "collective", "build-05b"):
        assert rows[name][1] == "ok", rows[name]
        assert float(rows[name][2]) >= 0 and rows[name][3] == "2345"  # the most on any one GPU
    assert "vLLM sleep level 1" in rows["colocated"][4]  # colocated runs asleep through the trainer's steps
    assert rows["tp2"][1] == "not run" and "needs 3 GPUs (2 visible)" in result.stdout
    assert rows["zero3"][1] == "not run" and "needs 3 GPUs (2 visible)" in result.stdout
    assert rows["model-05b"][1] == "not run"  # the stand-in built no model folder
    assert rows["model-05b-one-gpu"][1] == "not run"


def test_a_failing_check_fails_the_script(tmp_path):
    result = _run_with(tmp_path, 'case "$*" in -L) echo "GPU 0: H100" ;; *) echo 10 ;; esac\n', """case "$*" in
  *device_count*) echo 1 ;;
  *gpu_trainer.py*float16*) echo "loss nan" >&2; exit 1 ;;
  *) exit 0 ;;
esac
""")
    assert result.returncode == 1
    assert "[trainer-fp16] FAILED (exit 1)" in result.stderr and "loss nan" in result.stderr
    assert "trainer-fp16   | FAILED" in result.stdout


def test_without_vllm_the_engine_checks_say_so_and_the_trainer_checks_run(tmp_path):
    result = _run_with(tmp_path, 'case "$*" in -L) echo "GPU 0: H200" ;; *name*) echo "H200, 143771 MiB" ;; '
                                 '*) echo 10 ;; esac\n', """case "$*" in
  *device_count*) echo 1 ;;
  *"import vllm"*) exit 1 ;;
  *) exit 0 ;;
esac
""")
    assert result.returncode == 0, result.stderr
    rows = _rows(result.stdout)
    assert rows["trainer-bf16"][1] == rows["trainer-fp16"][1] == "ok"
    assert rows["colocated"][1] == "not run" and "needs vLLM (not importable" in result.stdout
    assert rows["disaggregated"][1] == "not run"  # 2 GPUs first: that row names the GPUs it needs
    assert "needs 2 GPUs (1 visible)" in result.stdout


def test_the_records_file_joins_each_checks_row_and_its_runs_record(tmp_path):
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("gpu_records", REPO / "bench" / "gpu_records.py")
    records = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(records)
    assert records.device_slug("NVIDIA H200") == "h200" and records.device_slug("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"
    (tmp_path / "shared-async.record.json").write_text(json.dumps(
        {"check": "shared-async", "trained_tokens_per_s_per_gpu": 812.5, "planned_gpu_gib": 72.0,
         "peak_gpu_mib": 70000, "accuracy_before": 0.3, "accuracy_after": 0.5}))
    doc = records.collect(str(tmp_path), ["trainer-bf16|bench|ok|20.1|2345", "shared-async|run|ok|95.0|70000"],
                          "NVIDIA H200", {"torch": "2.11.0"})
    assert doc["device"] == "NVIDIA H200" and [c["check"] for c in doc["checks"]] == ["trainer-bf16", "shared-async"]
    assert "trained_tokens_per_s_per_gpu" not in doc["checks"][0]
    assert doc["checks"][1]["trained_tokens_per_s_per_gpu"] == 812.5 and doc["checks"][1]["accuracy_after"] == 0.5


def test_smoke_only_runs_the_checks_it_names(tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    _stub(bin_, "nvidia-smi", """case "$*" in
  -L) echo "GPU 0: H200" ;;
  *name,memory.total*) echo "H200, 143771 MiB" ;;
  *memory.used*) echo 1000 ;;
esac
""")
    python = _stub(tmp_path, "python", """case "$*" in
  *device_count*) echo 1 ;;
  *) exit 0 ;;
esac
""")
    result = _run({"PATH": f"{bin_}:{os.environ['PATH']}", "PYTHON": str(python),
                   "SMOKE_ONLY": "colocated shared-async"}, tmp_path / "out")
    assert result.returncode == 0, result.stderr
    rows = _rows(result.stdout)
    assert rows["colocated"][1] == "ok" and rows["shared-async"][1] == "ok"
    assert rows["trainer-bf16"][1] == "not run" and "not selected (SMOKE_ONLY)" in result.stdout
