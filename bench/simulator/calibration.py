"""The simulator's costs fitted to measured CPU runs (bench/results/sync_vs_async.json,
written by bench/sync_vs_async.py): two scales, least squares on log(samples/s)."""
from __future__ import annotations

import functools
import math
from typing import Sequence

from .model import Costs, Setup, Workload, chain_lengths, simulate

# bench/sync_vs_async.py's setup. On the CPU, sync gives each phase the whole machine in
# turn; async gives rollout and trainer half the cores each (workers/cluster/placement.py).
CPU_CHAIN = {"max_value": 10, "max_terms": 12}
CPU_WORKLOAD = {"group_size": 8, "batch_prompts": 8, "micro_batch_tokens": 4096}
CPU_MAX_TOKENS = 48
CPU_MAX_STALENESS = 2
# Assumed, not fitted: how much slower a role runs on half of the cores. Small models
# parallelise poorly over threads, so well under the 2× of perfect scaling.
HALF_CORES_SLOWDOWN = 1.5
# Shape of the decode cost: docs/architecture.md §4 records 64 prompts × 16 tokens ≈ 0.14 s
# (≈ 8.75 ms a step at batch 64); assumed half fixed, half per sequence; a prefill token
# costs a quarter of a decode slot. Calibration fits one scale for all three.
CPU_DECODE = (4.4e-3, 4.4e-3 / 64, 4.4e-3 / 64 / 4)


@functools.lru_cache(maxsize=1)
def _cpu_prompt_tokens() -> int:
    from workers.tasks.datasets import gen_chain

    rows = gen_chain(2000, seed=0, **CPU_CHAIN)
    return round(sum(len(r["prompt"]) for r in rows) / len(rows))


def cpu_prediction(run: dict, gen_scale: float, train_per_token_s: float, steps: int = 12) -> float:
    """Simulated samples/s of one measured CPU run, given the two fitted costs."""
    slowdown = 1.0 if run["mode"] == "sync" else HALF_CORES_SLOWDOWN
    a, b, p = (x * gen_scale * slowdown for x in CPU_DECODE)
    costs = Costs(a, b, p, train_per_token_s * slowdown, sync_s=run["sync_ms"] / 1000, load_s=run["load_ms"] / 1000)
    work = Workload(lengths=chain_lengths(mean=float(run["len_mean"]), cap=CPU_MAX_TOKENS, **CPU_CHAIN),
                    prompt_tokens=_cpu_prompt_tokens(), **CPU_WORKLOAD)
    if run["mode"] == "sync":
        setup = Setup(mode="sync", steps=steps)
    else:
        setup = Setup(mode="async", update_mode=run["mode"], max_staleness=CPU_MAX_STALENESS, steps=steps,
                      stale_groups="drop_keep_slot")  # what the controller does
    return simulate(costs, work, setup).samples_per_s


def calibrate(runs: Sequence[dict], points: int = 7, tol: float = 0.01, steps: int = 12) -> dict:
    """Fit the decode-cost scale and the per-token training cost to measured runs.

    Least squares on log(samples/s) over every run: a coarse ``points``×``points`` grid
    in log space (±e^6 around gen scale 1 and 0.1 ms a trained token), then a pattern
    search (8 directions) from its best point until the step is below ``tol`` (two parameters: no
    optimiser library needed). Returns the fit and predicted vs measured per run.
    """
    def predict(run: dict, p: tuple[float, float]) -> float:
        return cpu_prediction(run, math.exp(p[0]), math.exp(p[1]), steps)

    @functools.lru_cache(maxsize=None)
    def loss(p: tuple[float, float]) -> float:
        return sum((math.log(predict(r, p)) - math.log(r["samples_per_s"])) ** 2 for r in runs)

    half, span, centre = max(1, points // 2), 6.0, (0.0, math.log(1e-4))
    grid = [(centre[0] + span * i / half, centre[1] + span * j / half)
            for i in range(-half, half + 1) for j in range(-half, half + 1)]
    best, step = min(grid, key=loss), span / half / 2

    def in_box(p: tuple[float, float]) -> tuple[float, float]:  # a cost → 0 fits nothing physical
        return tuple(min(c + span, max(c - span, v)) for c, v in zip(centre, p))

    while step >= tol:
        # diagonals too: async throughput is a min() of two bounds, its valleys run diagonally
        moves = [in_box((best[0] + dx * step, best[1] + dy * step)) for dx in (-1, 0, 1) for dy in (-1, 0, 1) if dx or dy]
        better = min(moves, key=loss)
        if loss(better) < loss(best):
            best = better
        else:
            step /= 2
    gen_scale, train_s = math.exp(best[0]), math.exp(best[1])
    return {"gen_scale": gen_scale, "decode_step_s": CPU_DECODE[0] * gen_scale,
            "decode_per_seq_s": CPU_DECODE[1] * gen_scale, "train_per_token_s": train_s,
            "rms_log_error": math.sqrt(loss(best) / len(runs)),
            "runs": [{"mode": r["mode"], "measured": r["samples_per_s"], "predicted": predict(r, best)} for r in runs]}
