"""The trainer/engine mismatch (docs/engine.md), measured through real runs: each run is
``python -m workers run``, vLLM sampling and the trainer recomputing, and the numbers are
its own ``mismatch/*`` metrics.

1. **How large.** Sync runs (every token at staleness 0, so r = log π_prox − log π_behav is
   the two numerics' disagreement alone) of ``--measure-steps`` steps, on the tiny model and
   the zoo Qwen2, in float32, bfloat16 and float32 with a LoRA adapter (rank 8 on the
   attention projections; B = 0 at the start, so the adapter path is measured, not a
   different policy). Reported: mean and max over the steps of mismatch/kl_stale0 and
   mismatch/abs_logp_max_stale0, and the ratio's p1 and p99.
2. **Does a correction change learning.** The zoo Qwen2 with ``algorithm.correction`` none,
   tis and mis (token level, cap 2), at staleness 0 (sync) and 4 (async, max_staleness 4),
   ``--seeds`` seeds, ``--learn-steps`` steps each: held-out greedy accuracy before and
   after, the last 10 steps' mean reward, and the shares of tokens dropped and truncated.

    .venv/bin/python bench/mismatch.py
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from sync_vs_async import ROOT, run_cli

logger = logging.getLogger("mismatch")

LORA = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
PRECISIONS = {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"}, "lora-fp32": {"dtype": "float32", "lora": LORA}}


def machine() -> str:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return head + ("+uncommitted" if dirty else "")


def models(tmp: Path) -> dict[str, dict]:
    """name -> the model and task sections of a spec."""
    from workers.models.modelzoo import ensure_zoo_model
    from workers.models.zoo_data import write_chat_dataset

    chat = str(write_chat_dataset(tmp / "chat.jsonl", 1500, seed=7, two_digit=True))
    return {"tiny": {"model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add?max_digits=2", "eval_size": 100}},
            "zoo-qwen2": {"model": {"path": str(ensure_zoo_model("qwen2"))}, "task": {"dataset": chat, "eval_size": 100}}}


def measure_spec(name: str, base: dict, precision: str, steps: int) -> dict:
    model = {**base["model"], **PRECISIONS[precision]}
    return {"name": f"bench-mismatch-{name}-{precision}", "model": model, "task": base["task"],
            "reward": {"function": "numeric_match"},
            "algorithm": {"loss": "ppo", "group_size": 8, "lr": 5e-4 if "lora" in model else 1e-4, "warmup_steps": 2},
            "rollout": {"max_tokens": 16, "temperature": 1.0},
            "schedule": {"mode": "sync", "batch_prompts": 8},
            "stop": {"max_steps": steps, "max_minutes": 10}, "eval": {"every_steps": 0, "prompts": 0}}


def learn_spec(base: dict, correction: str, staleness: int, seed: int, steps: int) -> dict:
    schedule = {"mode": "sync"} if staleness == 0 else {"mode": "async", "max_staleness": staleness}
    return {"name": f"bench-mismatch-learn-{correction}-eta{staleness}-s{seed}", "seed": seed, "model": base["model"],
            "task": base["task"], "reward": {"function": "numeric_match"},
            "algorithm": {"loss": "ppo", "group_size": 8, "lr": 1e-4, "warmup_steps": 2, "adv_std_norm": True,
                          "correction": correction, "correction_level": "token", "correction_cap": 2.0},
            "rollout": {"max_tokens": 16, "temperature": 1.0, "update_mode": "keep"},
            "schedule": {**schedule, "batch_prompts": 8},
            "stop": {"max_steps": steps, "max_minutes": 10}, "eval": {"every_steps": 0, "prompts": 100}}


def series(points: list[dict], key: str) -> list[float]:
    return [p["value"] for p in sorted(points, key=lambda p: p["step"]) if p["key"] == key]


def measure(name: str, base: dict, precision: str, steps: int, tmp: Path) -> dict:
    _, points, wall = run_cli(measure_spec(name, base, precision, steps), tmp, f"measure-{name}-{precision}")
    kl, top = series(points, "mismatch/kl_stale0"), series(points, "mismatch/abs_logp_max_stale0")
    return {"model": name, "precision": precision, "steps": len(kl), "wall_s": round(wall, 1),
            "kl_mean": statistics.mean(kl), "kl_max": max(kl), "abs_logp_max": max(top),
            "ratio_p1": min(series(points, "mismatch/ratio_p1")), "ratio_p99": max(series(points, "mismatch/ratio_p99"))}


def learn(base: dict, correction: str, staleness: int, seed: int, steps: int, tmp: Path) -> dict:
    result, points, wall = run_cli(learn_spec(base, correction, staleness, seed, steps), tmp,
                                   f"learn-{correction}-{staleness}-{seed}")
    reward = series(points, "reward/mean")
    return {"correction": correction, "staleness": staleness, "seed": seed, "steps": result["steps"],
            "wall_s": round(wall, 1), "acc_before": result["accuracy_before"], "acc_after": result["accuracy_after"],
            "reward_last10": statistics.mean(reward[-10:]),
            "kl_mean": statistics.mean(series(points, "mismatch/kl")),
            "dropped_share": statistics.mean(series(points, "mismatch/dropped_share")),
            "truncated_share": statistics.mean(series(points, "mismatch/truncated_share"))}


def tables(measured: list[dict], learned: list[dict]) -> str:
    lines = ["| model | precision | steps | mismatch/kl_stale0 mean (max) | max abs Δlog p | ratio p1 – p99 |",
             "|---|---|---|---|---|---|"]
    for r in measured:
        lines.append(f"| {r['model']} | {r['precision']} | {r['steps']} | {r['kl_mean']:.2e} ({r['kl_max']:.2e}) | "
                     f"{r['abs_logp_max']:.3f} | {r['ratio_p1']:.3f} – {r['ratio_p99']:.3f} |")
    lines += ["", "| correction | staleness ≤ | seeds | held-out acc before → after | reward, last 10 steps | "
              "mismatch/kl | dropped | truncated |", "|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict]] = {}
    for r in learned:
        groups.setdefault((r["correction"], r["staleness"]), []).append(r)
    for (correction, staleness), rows in groups.items():
        def each(key, fmt):
            return ", ".join(format(r[key], fmt) for r in rows)
        lines.append(f"| {correction} | {staleness} | {len(rows)} | {each('acc_before', '.3f')} → {each('acc_after', '.3f')} "
                     f"| {each('reward_last10', '.3f')} | {each('kl_mean', '.1e')} | {each('dropped_share', '.2%')} "
                     f"| {each('truncated_share', '.2%')} |")
    return "\n".join(lines)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure-steps", type=int, default=3)
    ap.add_argument("--learn-steps", type=int, default=30)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--corrections", default="none,tis,mis")
    ap.add_argument("--staleness", default="0,4")
    ap.add_argument("--skip-learn", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "mismatch.json"))
    args = ap.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)
    measured, learned = [], []
    with tempfile.TemporaryDirectory(prefix="fluxrl-bench-mismatch-") as tmp:
        bases = models(Path(tmp))
        for name, base in bases.items():
            for precision in PRECISIONS:
                measured.append(measure(name, base, precision, args.measure_steps, Path(tmp)))
                logger.info("%s", json.dumps(measured[-1]))
        if not args.skip_learn:
            for staleness in (int(s) for s in args.staleness.split(",")):
                for seed in (int(s) for s in args.seeds.split(",")):
                    for correction in args.corrections.split(","):
                        learned.append(learn(bases["zoo-qwen2"], correction, staleness, seed, args.learn_steps,
                                             Path(tmp)))
                        logger.info("%s", json.dumps(learned[-1]))
    table = tables(measured, learned)
    print(table)
    Path(args.out).write_text(json.dumps({
        "date": started.strftime("%Y-%m-%d"), "commit": commit(), "machine": machine(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "seconds": round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()),
        "measured": measured, "learned": learned, "table": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
