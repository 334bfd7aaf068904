"""RLHF with its four models on a laptop (examples/rlhf-critic.yaml: the tiny actor, a
critic, the tiny reward model in its own worker, the KL reference), run several times
beside a control that cannot learn (both learning rates 1e-12: every step runs, no
weight moves). Read from each run's metrics: the held-out reward (eval/accuracy: the
reward model's mean score of the greedy completions) and the true held-out accuracy
(eval/part/numeric_match: the exact-answer rule at weight 0), first and last evaluation.

  .venv/bin/python bench/rlhf_example.py --rounds 3
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

logger = logging.getLogger("rlhf_example")

VARIANTS = {
    "working": {},
    "lr0": {"algorithm": {"lr": 1e-12}, "critic": {"lr": 1e-12}},
    # RLHFuse's inference stage whole: the critic's forward beside the reward model and the reference
    "critic_stage": {"critic": {"forward": "stage"}},
}


def one_run(name: str, tag: str, workdir: Path, overrides: dict) -> dict:
    base = yaml.safe_load((ROOT / "examples" / "rlhf-critic.yaml").read_text())
    spec = merged(merged(base, VARIANTS[name]), overrides)
    result, points, wall = run_cli(spec, workdir, f"{name}-{tag}")
    series = lambda key: [p["value"] for p in sorted(points, key=lambda p: p["step"]) if p["key"] == key]  # noqa: E731
    reward, accuracy = series("eval/accuracy"), series("eval/part/numeric_match")
    row = {"variant": name, "steps": result["steps"], "wall_s": round(wall, 1),
           "reward_first": reward[0], "reward_last": reward[-1], "reward_best": max(reward),
           "reward_gain": round(reward[-1] - reward[0], 4),
           "accuracy_first": accuracy[0], "accuracy_last": accuracy[-1], "accuracy_best": max(accuracy),
           "explained_var_last": (series("critic/explained_var") or [None])[-1],
           "mean_batch": (series("reward_model/mean_batch") or [None])[-1],
           "critic_stage_samples": (series("critic_stage/samples") or [None])[-1],
           "critic_stage_lag": (series("critic_stage/lag") or [None])[-1],
           "samples_per_s": series("throughput/samples_per_s")[-1]}
    logger.info("%s", row)
    return row


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--control-rounds", type=int, default=1, help="rounds of the lr0 control (it cannot vary)")
    ap.add_argument("--steps", type=int, default=None, help="stop.max_steps (default: the example's)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "rlhf_critic.json"))
    args = ap.parse_args()
    overrides = {"stop": {"max_steps": args.steps}} if args.steps else {}
    names = args.variants.split(",")
    with tempfile.TemporaryDirectory(prefix="fluxrl-rlhf-") as tmp:
        runs = interleaved(names, args.rounds, lambda name, tag: one_run(name, tag, Path(tmp), overrides),
                           rounds_of={"lr0": args.control_rounds})
    logger.info("\n%-8s %-34s %-34s", "variant", "held-out reward gain (RM)", "true accuracy first -> last")
    for name in names:
        gains = ", ".join(f"{r['reward_gain']:+.3f}" for r in runs[name])
        acc = ", ".join(f"{r['accuracy_first']:.3f}->{r['accuracy_last']:.3f}" for r in runs[name])
        logger.info("%-8s %-34s %-34s", name, gains, acc)
        if len(runs[name]) > 1:
            gains = [r["reward_gain"] for r in runs[name]]
            logger.info("%-8s median gain %+.3f, range %+.3f .. %+.3f", "", statistics.median(gains), min(gains),
                        max(gains))
    Path(args.out).write_text(json.dumps({"runs": runs}, indent=2))
    logger.info("-> %s", args.out)


if __name__ == "__main__":
    main()
