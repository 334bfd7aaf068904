"""bench/gpu_smoke.sh's last step: every check's row and every run's record in one file,
bench/results/gpu_<device>.json (and OUT/gpu_results.json): the device, the versions, and per
check its status, seconds and peak GPU memory, and for a `workers run` its throughput per GPU,
the planner's GPU memory beside the peak, and held-out accuracy before and after.

    python bench/gpu_records.py OUT "check|what|status|seconds|peak MiB" ...
"""
from __future__ import annotations

import glob
import importlib.metadata as metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def device_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200', the results file's name."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower().replace("nvidia", "")).strip("_") or "gpu"


def collect(out: str, rows: list[str], device: str, versions: dict) -> dict:
    records = {}
    for path in sorted(glob.glob(os.path.join(out, "*.record.json"))):
        record = json.load(open(path))
        records[record["check"]] = record
    checks = []
    for row in rows:
        check, what, status, seconds, peak = row.split("|")
        checks.append({"check": check, "what": what, "status": status, "seconds": seconds, "peak_gpu_mib": peak,
                       **records.get(check, {})})
    return {"device": device, "versions": versions, "checks": checks}


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out, rows = args[0], args[1:]
    names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True).stdout.splitlines()
    device = names[0].strip() if names else "unknown"
    versions = {}
    for dist in ("torch", "vllm", "deepspeed", "transformers"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    doc = collect(out, rows, device, versions)
    text = json.dumps(doc, indent=1) + "\n"
    Path(out, "gpu_results.json").write_text(text)
    path = ROOT / "bench" / "results" / f"gpu_{device_slug(device)}.json"
    path.write_text(text)
    print(f"gpu_smoke: the records in {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
