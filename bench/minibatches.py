"""How many optimiser steps per batch should decoupled PPO take by default? The demo spec
(examples/add-async.yaml) as it is, with ``algorithm.minibatches`` set to each value asked,
interleaved over rounds on one machine in one invocation.

With one minibatch, π_prox is the policy being differentiated, so the ratio is 1 where the
gradient is taken and PPO's clip never binds (``policy/clip_frac`` 0): ``ppo`` is then
REINFORCE with a behaviour weight. From the second minibatch on, the policy has moved
away from π_prox and the clip acts. AReaL's default is several minibatches for that reason.
This measures what that costs and buys on the demo: final and best held-out greedy
accuracy, the last evaluation's distance from the best, trained samples/s, and the mean
clip fraction.

    .venv/bin/python bench/minibatches.py --values 1,2 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from pathlib import Path

import yaml

from sync_vs_async import ROOT, interleaved, merged, run_cli

logger = logging.getLogger("minibatches")


def one_run(minibatches: int, tag: str, workdir: Path, steps: int | None) -> dict:
    spec = yaml.safe_load((ROOT / "examples" / "add-async.yaml").read_text())
    over = {"name": f"minibatches-{minibatches}", "algorithm": {"minibatches": minibatches}}
    if steps:
        over["stop"] = {"max_steps": steps}
    spec = merged(spec, over)
    result, points, wall = run_cli(spec, workdir, f"mb{minibatches}-{tag}")
    evals = [(p["step"], p["value"]) for p in points if p["key"] == "eval/accuracy"]
    clip = [p["value"] for p in points if p["key"] == "policy/clip_frac"]
    accuracies = [a for _, a in sorted(evals)]
    row = {"minibatches": minibatches, "steps": result["steps"], "wall_s": round(wall, 1),
           "samples_per_s": round(result["trained_samples"] / result["seconds"], 1),
           "accuracy_before": result["accuracy_before"], "accuracy_after": result["accuracy_after"],
           "best": max(accuracies), "last_below_best": round(max(accuracies) - accuracies[-1], 4),
           "clip_frac_mean": round(statistics.fmean(clip), 5) if clip else None, "evals": sorted(evals)}
    logger.info("%s", {k: v for k, v in row.items() if k != "evals"})
    return row


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--values", default="1,2", help="minibatch counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="cut the demo to this many steps (default: its own)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "minibatches.json"))
    args = ap.parse_args()
    values = [int(v) for v in args.values.split(",")]
    with tempfile.TemporaryDirectory(prefix="fluxrl-minibatches-") as tmp:
        runs = interleaved(values, args.rounds, lambda value, tag: one_run(value, tag, Path(tmp), args.steps))
    base = statistics.median(r["samples_per_s"] for r in runs[values[0]])
    print(f"\n{'minibatches':>11} {'final acc. median [range]':>27} {'last-best (max)':>16} "
          f"{'samples/s median':>17} {'vs ' + str(values[0]):>6} {'clip_frac':>9}")
    for value in values:
        rs = runs[value]
        finals = [r["accuracy_after"] for r in rs]
        speed = statistics.median(r["samples_per_s"] for r in rs)
        print(f"{value:>11} {statistics.median(finals):>9.4f} [{min(finals):.4f}-{max(finals):.4f}] "
              f"{max(r['last_below_best'] for r in rs):>16.4f} {speed:>17.1f} {speed / base:>5.2f}x "
              f"{statistics.median(r['clip_frac_mean'] or 0 for r in rs):>9.4f}")
    Path(args.out).write_text(json.dumps({"values": values, "runs": {str(k): v for k, v in runs.items()}}, indent=2))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
