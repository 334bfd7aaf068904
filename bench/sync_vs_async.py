"""Synchronous vs asynchronous RL on the same spec, the same machine, one after another
in one invocation (this machine is shared and noisy: compare ratios, not absolutes).

    .venv/bin/python bench/sync_vs_async.py [--steps 30] [--modes sync,keep,interrupt,drain]

Task: running sums ("chain"), whose answers range from 1-2 characters to 30+ — the
long-tailed output lengths of real RL rollouts. Prints trained samples/s per mode, the
ratio to sync, held-out accuracy before → after the same number of trained samples,
weight-sync latency and the generation stall per update.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent

BASE = {
    "model": {"path": "builtin:tiny"},
    "task": {"dataset": "gen:chain?max_value=10&max_terms=12", "size": 4000, "eval_size": 200},
    "reward": {"function": "numeric_match"},
    # lr 1e-4 stays under the warm start's final SFT rate: RL keeps held-out accuracy instead of
    # knocking the model out of its minimum (docs/results.md)
    "algorithm": {"loss": "ppo", "group_size": 8, "lr": 1.0e-4},
    "rollout": {"engines": 1, "max_tokens": 48, "temperature": 1.0},
    "schedule": {"batch_prompts": 8, "max_staleness": 2},
    "stop": {"max_minutes": 20},
    "eval": {"every_steps": 0, "prompts": 200},
}

MODES = {
    "sync": {"schedule": {"mode": "sync"}, "rollout": {"update_mode": "keep"}},
    "keep": {"schedule": {"mode": "async"}, "rollout": {"update_mode": "keep"}},
    "interrupt": {"schedule": {"mode": "async"}, "rollout": {"update_mode": "interrupt"}},
    "drain": {"schedule": {"mode": "async"}, "rollout": {"update_mode": "drain"}},
}


def merged(base: dict, over: dict) -> dict:
    out = json.loads(json.dumps(base))
    for k, v in over.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


def interleaved(names: list[str], rounds: int, one, rounds_of: dict[str, int] | None = None) -> dict[str, list[dict]]:
    """Run every configuration once per round, round after round, so that load changing
    on a shared machine hits all of them alike; ``one(name, tag)`` runs one. ``rounds_of``
    gives some configurations fewer rounds (the first ones)."""
    out: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names:
            if r >= (rounds_of or {}).get(name, rounds):
                continue
            print(f"round {r + 1}/{rounds}: {name} (load average {os.getloadavg()[0]:.1f})...", flush=True)
            out[name].append(one(name, f"r{r}"))
    return out


def median_run(runs: list[dict]) -> dict:
    """The run with the median throughput, plus the spread over all rounds."""
    ordered = sorted(runs, key=lambda r: r["samples_per_s"])
    mid = dict(ordered[(len(ordered) - 1) // 2])  # the lower middle for an even count
    mid.update(rounds=len(runs), samples_per_s_min=ordered[0]["samples_per_s"],
               samples_per_s_max=ordered[-1]["samples_per_s"], all_samples_per_s=[r["samples_per_s"] for r in runs])
    return mid


def run_cli(spec: dict, workdir: Path, stem: str) -> tuple[dict, list[dict], float]:
    """``python -m workers run`` on ``spec`` (written to ``workdir/stem.yaml``, the run in
    ``workdir/stem``): its result.json, its metric points and the wall time."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"{stem}.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = workdir / stem
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "workers", "run", str(path), "--out", str(out), "--no-progress"],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{stem} failed:\n{proc.stderr[-3000:]}")
    points = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return json.loads((out / "result.json").read_text()), points, time.time() - t0


def run(mode: str, steps: int, workdir: Path, overrides: dict | None = None, base: dict = BASE) -> dict:
    """One run of ``python -m workers run`` with ``base`` + ``overrides`` (default: MODES[mode])."""
    over = MODES[mode] if overrides is None else overrides
    spec = merged(merged(base, over), {"name": f"bench-{mode}", "stop": {"max_steps": steps}})
    result, points, wall = run_cli(spec, workdir, mode)
    series = lambda key: [p["value"] for p in points if p["key"] == key]  # noqa: E731
    result.update(
        mode=mode, wall_s=wall,
        sync_ms=statistics.median(series("weights/sync_ms")),
        load_ms=statistics.median(series("weights/load_ms")),
        stall_ms=statistics.median(series("weights/gen_stall_ms")) if series("weights/gen_stall_ms") else None,
        staleness_mean=statistics.mean(series("staleness/mean")),
        len_mean=statistics.mean(series("lengths/mean")), len_p99=max(series("lengths/p99")),
        spearman=series("ranker/spearman")[-1] if series("ranker/spearman") else None,
        top10_recall=series("ranker/top10_recall")[-1] if series("ranker/top10_recall") else None,
        long_tail_share=statistics.median(series("generation/long_tail_share")),
        overlap=statistics.median(series("inference/overlap")) if series("inference/overlap") else None,
        trainer_tokens_per_s=statistics.median(series("trainer/tokens_per_s")) if series("trainer/tokens_per_s")
        else None,
        bubble=statistics.median(series("pipeline/bubble")) if series("pipeline/bubble") else None,
    )
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--modes", default="sync,keep,interrupt,drain")
    p.add_argument("--rounds", type=int, default=1, help="interleaved repetitions; the median run is reported")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "sync_vs_async.json"))
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = interleaved(args.modes.split(","), args.rounds,
                           lambda mode, tag: run(mode, args.steps, Path(tmp) / tag))
        results = [median_run(rs) for rs in runs.values()]
    base = next((r for r in results if r["mode"] == "sync"), results[0])
    print()
    print(f"{'mode':<10} {'samples/s':>9} {'× sync':>7} {'acc before→after':>17} {'stale':>6} "
          f"{'sync ms':>8} {'load ms':>8} {'stall ms':>9} {'len mean/p99':>13}")
    for r in results:
        stall = f"{r['stall_ms']:.1f}" if r["stall_ms"] is not None else "-"
        print(f"{r['mode']:<10} {r['samples_per_s']:>9.2f} {r['samples_per_s'] / base['samples_per_s']:>7.2f} "
              f"{r['accuracy_before']:>8.3f}→{r['accuracy_after']:.3f} {r['staleness_mean']:>6.2f} "
              f"{r['sync_ms']:>8.1f} {r['load_ms']:>8.1f} {stall:>9} {r['len_mean']:>6.1f}/{r['len_p99']:<5.0f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
