"""N LoRA runs sharing one engine pool (rollout.share_engines) against the same N runs each
with its own engine, side by side in one invocation (docs/guides/shared-engines.md).

Each arm starts N copies of one LoRA spec at once (`python -m workers run`, one process
each, teams team-1 .. team-N, seeds 0 .. N-1) and waits for all of them. Printed per arm:
the aggregate trained samples/s (every run's samples over the arm's wall time, start-up
included, and over the steady part: from the last run's first step to the first run's end),
and the peak resident memory of the engines and of everything (each process's VmHWM from
the runs' result.json; a shared pool's processes, which every run on it reports, are counted
once).

    .venv/bin/python bench/shared_engines.py --runs 2 --steps 150
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
logger = logging.getLogger("shared_engines")


def spec_for(index: int, steps: int, shared: bool) -> dict:
    return {
        "name": f"bench-shared-{index}" if shared else f"bench-separate-{index}",
        "model": {"path": "builtin:tiny", "lora": {"rank": 8, "alpha": 16,
                                                   "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}},
        "task": {"dataset": "gen:add?max_digits=2", "size": 4000, "eval_size": 16},
        "reward": {"function": "numeric_match"},
        "algorithm": {"loss": "ppo", "group_size": 8, "lr": 2.0e-3},
        "rollout": {"engines": 1, "max_tokens": 8, "update_mode": "keep", "share_engines": shared},
        "schedule": {"mode": "async", "max_staleness": 2, "batch_prompts": 16},
        "stop": {"max_steps": steps, "max_minutes": 30},
        "eval": {"every_steps": 0, "prompts": 16},
        "seed": index,
    }


ENGINE_KEYS = ("engine",)  # memory_peak_gib's engine entries: "engine 0 server", "engine 0 vLLM core"


def arm(runs: int, steps: int, shared: bool, workdir: Path, pools: Path) -> dict:
    procs = []
    t0 = time.time()
    for i in range(runs):
        folder = workdir / ("shared" if shared else "separate") / f"run-{i}"
        folder.mkdir(parents=True)
        (folder / "spec.yaml").write_text(yaml.safe_dump(spec_for(i, steps, shared)))
        env = {**os.environ, "FLUXRL_POOL_DIR": str(pools), "FLUXRL_POOL_TEAM": f"team-{i + 1}",
               "FLUXRL_POOL_IDLE_S": "5"}
        log = open(folder / "engine.log", "wb")
        procs.append((folder, subprocess.Popen([sys.executable, "-m", "workers", "run", str(folder / "spec.yaml"),
                                                "--out", str(folder / "out"), "--no-progress"], cwd=ROOT, env=env,
                                               stdout=log, stderr=subprocess.STDOUT)))
    for folder, proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"{folder} failed:\n{(folder / 'engine.log').read_text()[-3000:]}")
    wall = time.time() - t0
    results, firsts, lasts, samples = [], [], [], 0
    for folder, _ in procs:
        result = json.loads((folder / "out" / "result.json").read_text())
        points = [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
        times = sorted(p["time"] for p in points if p["key"] == "throughput/samples_per_s")
        firsts.append(times[0])
        lasts.append(times[-1])
        results.append(result)
        samples += result["trained_samples"]
    # the steady window: every run is training (the last first step .. the first last step)
    start, end = max(firsts), min(lasts)
    steady = 0
    for folder, _ in procs:
        points = [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
        steps_in = [p for p in points if p["key"] == "throughput/samples_per_s" and start <= p["time"] <= end]
        steady += len(steps_in) * 16 * 8  # batch_prompts x group_size per step
    engines, others = {}, 0.0
    for result in results:
        for name, gib in (result.get("memory_peak_gib") or {}).items():
            if name.startswith(ENGINE_KEYS):
                # a shared pool's processes are reported by every run on it: count them once
                key = name if shared else (id(result), name)
                engines[key] = max(engines.get(key, 0.0), gib)
            else:
                others += gib
    return {"arm": "shared pool" if shared else "separate engines", "runs": runs, "steps": steps,
            "wall_s": round(wall, 1), "samples_per_s": round(samples / wall, 2),
            "steady_samples_per_s": round(steady / (end - start), 2) if end > start else None,
            "engine_gib": round(sum(engines.values()), 2), "total_gib": round(sum(engines.values()) + others, 2),
            "staleness_max": max(r["staleness_max"] for r in results)}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "shared_engines.json"))
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from workers.rollout.pool_registry import DIR_ENV, stop_pools

    rows = []
    with tempfile.TemporaryDirectory(prefix="fluxrl-bench-shared-") as tmp:
        pools = Path(tmp) / "pools"
        pools.mkdir(mode=0o700)
        os.environ[DIR_ENV] = str(pools)
        try:
            for shared in (False, True):
                rows.append(arm(args.runs, args.steps, shared, Path(tmp), pools))
                logger.info("%s", rows[-1])
        finally:
            stop_pools()
    separate, shared = rows
    ratio = {k: round(shared[k] / separate[k], 2) for k in ("samples_per_s", "steady_samples_per_s", "engine_gib",
                                                            "total_gib") if shared[k] and separate[k]}
    header = f"{'arm':18} {'runs':>4} {'wall s':>7} {'samples/s':>9} {'steady':>7} {'engine GiB':>10} {'all GiB':>8}"
    logger.info(header)
    for r in rows:
        logger.info("%-18s %4d %7.1f %9.2f %7s %10.2f %8.2f", r["arm"], r["runs"], r["wall_s"], r["samples_per_s"],
                    r["steady_samples_per_s"], r["engine_gib"], r["total_gib"])
    logger.info("shared / separate: %s", ratio)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "shared_over_separate": ratio}, indent=2))


if __name__ == "__main__":
    main()
