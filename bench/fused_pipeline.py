"""RLHFuse's intra-stage fusion measured: the actor's and the critic's training step as two
pipelines over two rank processes (gloo on loopback, one core each), run one after the
other (``sequential``) or fused into one schedule (``fused``, workers/train/pipeline.py),
interleaved over rounds in one invocation.

    .venv/bin/python bench/fused_pipeline.py [--rounds 3] [--micro 8] [--rows 8] [--steps 5]

Per schedule: the median step's wall time (the slowest rank's), the bubble share (the
ranks' mean share of the step spent waiting for the other), the ratio to sequential, and
what an ideal machine predicts (forward 1, backward 2: ``simulate``). The batch: ``micro``
micro-batches of ``rows`` sequences of 16–48 tokens with GAE's per-token fields, the tiny
model (``--model`` for another Llama/Qwen2-style folder), its critic's value head random.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from workers.models.tinymodel import ensure_tiny_model  # noqa: E402
from workers.train.pipeline import (Hyper, fused_schedule, micro_batches,  # noqa: E402
                                    sequential_schedule, simulate)
from workers.train.pipeline_group import run_step  # noqa: E402
from workers.train.samples import TrainSample  # noqa: E402


def samples(n: int, vocab: int, seed: int) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(8, 16))]
        k = rng.randint(8, 32)
        out.append(TrainSample(prompt, [rng.randrange(3, vocab) for _ in range(k)],
                               [-rng.uniform(3.0, 6.0) for _ in range(k)], 0.0,
                               token_advantages=[rng.uniform(-1, 1) for _ in range(k)],
                               values=[rng.uniform(-0.5, 0.5) for _ in range(k)],
                               returns=[rng.uniform(-1, 1) for _ in range(k)]))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--micro", type=int, default=8, help="micro-batches per step")
    p.add_argument("--rows", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--steps", type=int, default=5, help="steps per round (the median is kept)")
    p.add_argument("--model", default=None, help="a model folder (default: the tiny model)")
    p.add_argument("--json", default=str(BENCH / "results" / "fused_pipeline.json"))
    args = p.parse_args()
    from transformers import AutoConfig

    model = args.model or str(ensure_tiny_model(progress=False))
    vocab = AutoConfig.from_pretrained(model).vocab_size
    mbs = micro_batches(samples(args.micro * args.rows, vocab, seed=0), rows=args.rows)
    hyper = Hyper(denominator=float(sum(mb["mask"].sum() for mb in mbs)), head_seed=0)
    ideal = {"sequential": simulate(sequential_schedule(2, args.micro))[1],
             "fused": simulate(fused_schedule(2, args.micro))[1]}
    runs: dict[str, list] = {"sequential": [], "fused": []}
    for r in range(args.rounds):
        for kind in runs:
            report = run_step(model, mbs, kind, stages=2, hyper=hyper, steps=args.steps)
            print(f"round {r + 1}/{args.rounds} {kind}: step {report.wall_s * 1000:.1f} ms, "
                  f"bubble {report.bubble:.3f}", flush=True)
            runs[kind].append(report)
    rows = []
    base = statistics.median(x.wall_s for x in runs["sequential"])
    print(f"\n{'schedule':<11} {'step ms (median)':>16} {'range':>17} {'× sequential':>13} {'bubble':>7} "
          f"{'ideal bubble':>12} {'ideal ×':>8}")
    for kind, reports in runs.items():
        walls = sorted(x.wall_s for x in reports)
        wall = statistics.median(walls)
        bubble = statistics.median(x.bubble for x in reports)
        ideal_bubble = 1 - 2 * args.micro * 3 / ideal[kind]  # each rank: micro × (1 + 2) per model
        rows.append({"schedule": kind, "step_s": wall, "step_s_min": walls[0], "step_s_max": walls[-1],
                     "speedup": base / wall, "bubble": bubble, "ideal_makespan": ideal[kind],
                     "ideal_bubble": ideal_bubble, "micro": args.micro, "rows": args.rows, "rounds": args.rounds})
        print(f"{kind:<11} {wall * 1000:>16.1f} {walls[0] * 1000:>8.1f}–{walls[-1] * 1000:<8.1f} "
              f"{base / wall:>13.2f} {bubble:>7.3f} {ideal_bubble:>12.3f} {ideal['sequential'] / ideal[kind]:>8.2f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
