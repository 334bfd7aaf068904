"""The simulator's command line (python -m bench.simulator, see __init__): the modes side
by side on one cluster, the split recommendation per cluster size, or the calibration."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .calibration import HALF_CORES_SLOWDOWN, calibrate
from .model import (MODES, SimResult, Workload, best_of, cluster_costs, compare, lognormal_lengths,
                    planned_resources, recommend)
from .plot import split_plot

ROOT = Path(__file__).resolve().parents[2]
DESCRIPTION = "Discrete-event simulator of RL training: where does the time go at cluster scale?"


def parse_gpus(text: str) -> list[int]:
    """"8..256" → powers of two from 8 to 256; "8,24,64" → those; "64" → [64]."""
    if ".." in text:
        lo, hi = (int(x) for x in text.split(".."))
        out, g = [], lo
        while g <= hi:
            out.append(g)
            g *= 2
        return out
    return [int(x) for x in text.split(",")]


def _row(label: str, r: SimResult) -> str:
    return (f"{label:<26} {r.samples_per_s:>10.3f} {r.gen_idle:>9.2f} {r.train_idle:>10.2f} "
            f"{r.staleness_mean:>6.2f} {r.dropped_groups:>5}")


HEADER = f"{'':<26} {'samples/s':>10} {'gen idle':>9} {'train idle':>10} {'stale':>6} {'drops':>5}"


def _workload(args) -> Workload:
    return Workload(lengths=lognormal_lengths(args.median_len, args.sigma, args.max_tokens, seed=args.seed),
                    prompt_tokens=args.prompt_tokens, group_size=args.group_size, batch_prompts=args.batch_prompts,
                    micro_batch_tokens=args.micro_batch_tokens)


def _setup_kw(args) -> dict:
    return {"predictor_corr": args.predictor_corr, "max_staleness": args.max_staleness, "steps": args.steps,
            "warmup_steps": args.warmup_steps, "seed": args.seed, "stale_groups": args.stale_groups}


def main_calibrate(args) -> None:
    path = Path(args.measured)
    if not path.is_file():
        raise SystemExit(f"{path} does not exist yet: run bench/sync_vs_async.py first")
    runs = json.loads(path.read_text())
    fit = calibrate(runs)
    print(f"fitted on {len(runs)} CPU runs ({path}); assumed: async roles run {HALF_CORES_SLOWDOWN}× slower on half the cores")
    print(f"  decode step = {fit['decode_step_s'] * 1e3:.2f} ms + {fit['decode_per_seq_s'] * 1e3:.3f} ms × batch, "
          f"training = {fit['train_per_token_s'] * 1e3:.3f} ms a token, rms log error {fit['rms_log_error']:.3f}")
    print(f"{'mode':<10} {'measured':>9} {'predicted':>9} {'error':>7}")
    for r in fit["runs"]:
        print(f"{r['mode']:<10} {r['measured']:>9.2f} {r['predicted']:>9.2f} {r['predicted'] / r['measured'] - 1:>+7.0%}")


def main_recommend(args, gpu_counts: list[int]) -> None:
    work = _workload(args)
    report = recommend(args.model_size, gpu_counts, work, _setup_kw(args))
    print(f"{args.model_size / 1e9:g}B model; {args.batch_prompts} prompts × {args.group_size} a step; lengths lognormal "
          f"median {args.median_len:g}, σ {args.sigma:g}, ≤ {args.max_tokens} (mean {np.mean(work.lengths):.0f}); "
          f"predictor ρ {args.predictor_corr:g}; η {args.max_staleness}")
    print(f"{'GPUs':>5} {'recommended split':>20} {'samples/s':>10}  " + "  ".join(f"{m + ' best':>18}" for m in MODES)
          + f"  {'sync colocated':>14}")
    for row in report:
        if not row["best"]:
            print(f"{row['gpus']:>5}  cannot hold the model")
            continue
        mode, (rollout, res) = best_of(row["curves"])
        cells = "  ".join(f"{row['best'][m][1].samples_per_s:>8.2f} @{row['best'][m][0]:>3}/{row['gpus'] - row['best'][m][0]:<4}"
                          if m in row["best"] else f"{'-':>18}" for m in MODES)
        colocated = f"{row['colocated_sync'].samples_per_s:>14.2f}" if row["colocated_sync"] else f"{'-':>14}"
        split = f"{rollout} gen / {row['gpus'] - rollout} train"
        if row["colocated_sync"] and row["colocated_sync"].samples_per_s > res.samples_per_s:
            mode, split, res = "sync colocated", "all GPUs, in turn", row["colocated_sync"]
        print(f"{row['gpus']:>5} {split:>20} {res.samples_per_s:>10.2f}  "
              f"{cells}  {colocated}   ({mode})")
        planned = planned_resources(args.model_size, row["gpus"], rollout, work)
        if planned is not None and mode != "sync colocated":
            print(f"{'':>5} spec: rollout: {json.dumps(planned['rollout'])}, resources: "
                  f"{json.dumps(planned['resources'])}")
    feasible = [r["gpus"] for r in report if r["best"]]
    if feasible and args.plot:
        focus = feasible[len(feasible) // 2]
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        Path(args.plot).write_text(split_plot(args.model_size, report, focus))
        print(f"plot: {args.plot}")


def main_compare(args, gpus: int) -> None:
    work = _workload(args)
    rollout = args.rollout_gpus or gpus // 2
    sized = cluster_costs(args.model_size, rollout, gpus - rollout, work)
    if sized is None:
        raise SystemExit(f"{rollout} rollout / {gpus - rollout} trainer GPUs cannot hold a {args.model_size:g} model")
    print(f"{args.model_size / 1e9:g}B model, {rollout} rollout GPUs ({sized[1]} engines) / {gpus - rollout} trainer GPUs")
    print(HEADER)
    for mode, r in compare(sized[0], work, sized[1], **_setup_kw(args)).items():
        print(_row(mode, r))


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.simulator", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recommend", action="store_true", help="sweep the rollout/trainer split per cluster size")
    p.add_argument("--calibrate", action="store_true", help="fit costs to the measured CPU runs")
    p.add_argument("--measured", default=str(ROOT / "bench" / "results" / "sync_vs_async.json"))
    p.add_argument("--model-size", type=float, default=7e9, help="parameters")
    p.add_argument("--gpus", default="64", help='"64", "8,32,64" or "8..256" (powers of two)')
    p.add_argument("--rollout-gpus", type=int, default=0, help="without --recommend: GPUs generating (default half)")
    p.add_argument("--batch-prompts", type=int, default=512)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--median-len", type=float, default=1024)
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal spread of completion lengths")
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--micro-batch-tokens", type=int, default=262144, help="stream mode's training micro-batch")
    p.add_argument("--predictor-corr", type=float, default=0.8, help="ranker quality for +skew (log-space correlation)")
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--stale-groups", choices=("train", "drop", "drop_keep_slot"), default="train",
                   help="async: what happens to a group older than --max-staleness (see Setup)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=str(ROOT / "bench" / "results" / "split.svg"))
    args = p.parse_args(argv)
    if args.calibrate:
        main_calibrate(args)
    elif args.recommend:
        main_recommend(args, parse_gpus(args.gpus))
    else:
        main_compare(args, parse_gpus(args.gpus)[0])
