"""Ablation of the long-tail techniques on the long-tailed chain task: the same spec with
each technique off/on, one after another in one invocation. Stream training is StreamRL's
stream generation; fused scoring (per-sample rule scoring during generation) and
longest-first (a task order) are simplified relatives of RLHFuse's inter-stage fusion and
StreamRL's skewness-aware dispatch, not those mechanisms (README, issue 29).

    .venv/bin/python bench/ablation.py [--steps 20] [--rounds 3]

Every configuration runs with ``max_num_seqs: 16`` (fewer sequences than a step's 64
samples), so requests queue in the engine as on a loaded GPU and dispatch order matters.
Prints trained samples/s, the ratio to plain sync, and the idle share of generation and
training over the run.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from sync_vs_async import BASE, ROOT, interleaved, median_run, merged, run

# Throughput only: no held-out evaluation before and after (it is not timed, but costs minutes).
QUEUED = merged(BASE, {"rollout": {"max_num_seqs": 16}, "eval": {"prompts": 0}})
CONFIGS = {
    "sync (plain: barrier scoring, fifo)": {"schedule": {"mode": "sync"}, "rollout": {"fused_scoring": False}},
    "sync + fused scoring": {"schedule": {"mode": "sync"}},
    "sync + longest-first dispatch": {"schedule": {"mode": "sync", "dispatch": "longest_first"}},
    "sync + stream training": {"schedule": {"mode": "sync", "stream_train": True}},
    "sync + stream + longest-first": {"schedule": {"mode": "sync", "stream_train": True, "dispatch": "longest_first"}},
    "async keep": {"schedule": {"mode": "async"}},
    "async keep + longest-first": {"schedule": {"mode": "async", "dispatch": "longest_first"}},
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1, help="interleaved repetitions; the median run is reported")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "ablation.json"))
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        names = list(CONFIGS)
        runs = interleaved(names, args.rounds, lambda name, tag: run(
            f"ablation{names.index(name)}", args.steps, Path(tmp) / tag, CONFIGS[name], base=QUEUED))
        results = [{"config": name, **median_run(rs)} for name, rs in runs.items()]
    base = results[0]["samples_per_s"]
    print(f"\n{'configuration':<34} {'samples/s':>9} {'(min–max)':>15} {'× sync':>7} {'idle gen':>9} "
          f"{'idle train':>10} {'ranker ρ':>8}")
    for r in results:
        rho = f"{r['spearman']:.2f}" if r.get("spearman") is not None else "-"
        spread = f"{r['samples_per_s_min']:.1f}–{r['samples_per_s_max']:.1f}"
        print(f"{r['config']:<34} {r['samples_per_s']:>9.2f} {spread:>15} {r['samples_per_s'] / base:>7.2f} "
              f"{r['idle_generation']:>9.2f} {r['idle_training']:>10.2f} {rho:>8}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
