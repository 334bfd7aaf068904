"""Agentic RL measured (docs/guides/agentic.md): the zoo's tool-calling Qwen2
(``builtin:qwen2-tools``) trained on examples/agentic-tools.yaml, multi-turn episodes with a
calculator, sync against async (keep), interleaved, in one invocation.

1. **Tools against no tools.** Held-out greedy accuracy of the same model on the run's
   held-out ``gen:tool_arith`` prompts, offered the calculator (the example's system prompt;
   episodes of at most two turns, HF generation, workers/models/toolzoo.py) and asked
   without it (no system prompt), before RL and after each run (its ``final_model``).
   The runs' own held-out evaluation (vLLM, the ``tools`` environment) is reported beside it.
2. **Async (keep) against sync** on the same spec: trained samples/s and training seconds
   to a target held-out accuracy (per round, the sync run's accuracy after its budget, or
   ``--target``), periodic evaluations taken out (vs_plain.engine_curve); ``--rounds``
   interleaved rounds, the median-throughput run reported with the spread.
3. **Token exactness**: ``agent/token_exact`` over every step of every run (the share of a
   step's trained samples whose trained ids equal the engine's), which must be 1.0; and how
   many policy versions an episode's generated tokens carry (``agent/versions_per_episode``).

    .venv/bin/python bench/agentic.py [--steps 40] [--rounds 2] [--modes sync,keep]
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import yaml  # noqa: E402
from tqdm import tqdm  # noqa: E402

from sync_vs_async import ROOT, median_run, merged, run_cli  # noqa: E402
from vs_plain import engine_curve, time_to  # noqa: E402
from vs_trl import meta  # noqa: E402

logger = logging.getLogger("agentic")

EXAMPLE = ROOT / "examples" / "agentic-tools.yaml"
MODES = {"sync": {"schedule": {"mode": "sync"}, "rollout": {"update_mode": "keep"}},
         "keep": {"schedule": {"mode": "async"}, "rollout": {"update_mode": "keep"}}}


def base_spec(steps: int, eval_every: int, eval_prompts: int, minutes: float) -> dict:
    """The example's spec with the bench's budget (steps, evaluations)."""
    spec = yaml.safe_load(EXAMPLE.read_text())
    return merged(spec, {"stop": {"max_steps": steps, "max_minutes": minutes},
                         "eval": {"every_steps": eval_every, "prompts": eval_prompts}})


def held_out_rows(spec: dict, n: int) -> list[dict]:
    """The run's own held-out rows (task.eval_size of them, never trained on)."""
    from workers.tasks.datasets import load_rows

    task = spec["task"]
    _, held = load_rows(task["dataset"], task.get("size", 4000), task.get("eval_size", 200), task.get("seed", 0))
    return held[:n]


def tool_accuracy(folder: str, rows: list[dict]) -> dict:
    """Greedy accuracy of the model in ``folder`` with the calculator and without it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.models.toolzoo import episode_accuracy

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tok, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
        with_tools = episode_accuracy(model, tok, rows, tools=True, details=True)
        without = episode_accuracy(model, tok, rows, tools=False, details=True)
    finally:
        torch.set_num_threads(threads)
    return {"with_tools": with_tools["accuracy"], "without_tools": without["accuracy"],
            "tool_call_share": with_tools["tool_call_share"], "tool_call_share_without": without["tool_call_share"]}


def series(points: list[dict], key: str) -> list[float]:
    return [p["value"] for p in sorted(points, key=lambda p: p["step"]) if p["key"] == key]


def one_run(mode: str, spec: dict, workdir: Path, rows: list[dict]) -> dict:
    run_spec = merged(merged(spec, MODES[mode]), {"name": f"bench-agentic-{mode}"})
    result, points, wall = run_cli(run_spec, workdir, mode)
    curve, eval_s = engine_curve(points, result["seconds"])
    exact = series(points, "agent/token_exact")
    ends = sorted({p["key"] for p in points if p["key"].startswith("agent/end/")})
    out = {
        "mode": mode, "steps": result["steps"], "trained_samples": result["trained_samples"],
        "seconds": result["seconds"], "wall_s": round(wall, 1), "eval_s": round(eval_s, 1),
        "train_s": round(result["seconds"] - eval_s, 1),
        "samples_per_s": result["trained_samples"] / max(1e-9, result["seconds"] - eval_s),
        "engine_samples_per_s": result["samples_per_s"],
        "accuracy_before": result["accuracy_before"], "accuracy_after": result["accuracy_after"], "curve": curve,
        "token_exact_min": min(exact) if exact else None, "token_exact_steps": len(exact),
        "versions_per_episode_mean": statistics.mean(series(points, "agent/versions_per_episode") or [0.0]),
        "versions_per_episode_max": max(series(points, "agent/versions_per_episode") or [0.0]),
        "turns_mean": statistics.mean(series(points, "agent/turns") or [0.0]),
        "tool_calls_mean": statistics.mean(series(points, "agent/tool_calls") or [0.0]),
        "tool_errors_mean": statistics.mean(series(points, "agent/tool_errors") or [0.0]),
        "tool_ms_median": statistics.median(series(points, "agent/tool_ms") or [0.0]),
        "end_shares": {k.rsplit("/", 1)[1]: statistics.mean(series(points, k)) for k in ends},
        "staleness_mean": statistics.mean(series(points, "staleness/mean") or [0.0]),
        "reward_first5": statistics.mean(series(points, "reward/mean")[:5] or [0.0]),
        "reward_last5": statistics.mean(series(points, "reward/mean")[-5:] or [0.0]),
    }
    if result.get("final_model"):
        out["after"] = tool_accuracy(result["final_model"], rows)  # HF, with and without the calculator
    return out


def summarize(runs: list[dict]) -> dict:
    out = median_run(runs)
    times = sorted((r["time_to_target_s"] if r["time_to_target_s"] is not None else float("inf")) for r in runs)
    ttt = times[(len(times) - 1) // 2]
    out.update(time_to_target_s=None if ttt == float("inf") else ttt,
               reached_target=sum(r["time_to_target_s"] is not None for r in runs),
               all_time_to_target_s=[r["time_to_target_s"] for r in runs],
               all_accuracy_after=[r["accuracy_after"] for r in runs])
    return out


def table(before: dict, summary: dict[str, dict], exact_min: float | None) -> str:
    lines = [f"held-out greedy accuracy before RL: {before['with_tools']:.3f} with the calculator, "
             f"{before['without_tools']:.3f} without", "",
             "| mode | samples/s (min–max) | × sync | to target s | reached | run's held-out acc before → after | "
             "after RL with tools / without (HF) | versions per episode (max) |",
             "|---|---|---|---|---|---|---|---|"]
    sync = summary.get("sync")
    for mode, s in summary.items():
        speed = f"{s['samples_per_s'] / sync['samples_per_s']:.2f}" if sync else "-"
        ttt = f"{s['time_to_target_s']:.0f}" if s["time_to_target_s"] is not None else "never"
        after = s.get("after") or {}
        lines.append(f"| {mode} | {s['samples_per_s']:.2f} ({s['samples_per_s_min']:.2f}–{s['samples_per_s_max']:.2f}) "
                     f"| {speed} | {ttt} | {s['reached_target']}/{s['rounds']} | {s['accuracy_before']:.3f} → "
                     f"{s['accuracy_after']:.3f} | {after.get('with_tools', float('nan')):.3f} / "
                     f"{after.get('without_tools', float('nan')):.3f} | {s['versions_per_episode_mean']:.2f} "
                     f"({s['versions_per_episode_max']:.2f}) |")
    lines += ["", f"agent/token_exact over every step of every run: min {exact_min}"]
    return "\n".join(lines)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default="sync,keep", help="sync first: it sets each round's target")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-prompts", type=int, default=200)
    ap.add_argument("--minutes", type=float, default=15, help="each run's stop.max_minutes")
    ap.add_argument("--target", type=float, default=None, help="held-out accuracy to reach (default: per round, "
                    "the first mode's accuracy after its budget)")
    ap.add_argument("--model", default=None, help="a model folder in Qwen2's tool format (default: builtin:qwen2-tools)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "agentic.json"))
    args = ap.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)
    info = meta(sys.argv)  # date, commit, machine, the exact command: as the run starts
    from workers.models.toolzoo import ensure_tool_model

    model = args.model or str(ensure_tool_model(progress=True))
    spec = merged(base_spec(args.steps, args.eval_every, args.eval_prompts, args.minutes), {"model": {"path": model}})
    rows = held_out_rows(spec, args.eval_prompts)
    before = tool_accuracy(model, rows)
    logger.info("before RL: %s", json.dumps(before))
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="fluxrl-bench-agentic-") as tmp:
        bar = tqdm(total=args.rounds * len(modes), desc="agentic runs", unit="run")
        for r in range(args.rounds):
            target = args.target
            for mode in modes:
                bar.set_postfix(round=r + 1, mode=mode)
                run = one_run(mode, spec, Path(tmp) / f"r{r}", rows)
                if target is None:
                    target = run["accuracy_after"]  # the round's first mode sets its target
                run.update(round=r, target=target, time_to_target_s=time_to(run["curve"], target))
                runs[mode].append(run)
                logger.info("%s", json.dumps({k: v for k, v in run.items() if k != "curve"}))
                bar.update()
        bar.close()
    summary = {m: summarize(rs) for m, rs in runs.items()}
    exact = [r["token_exact_min"] for rs in runs.values() for r in rs if r["token_exact_min"] is not None]
    exact_min = min(exact) if exact else None
    text = table(before, summary, exact_min)
    print(text)
    Path(args.out).write_text(json.dumps({
        "meta": info, "seconds": round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()),
        "model": args.model or "builtin:qwen2-tools", "spec": spec, "before": before, "token_exact_min": exact_min,
        "token_exact_steps": sum(r["token_exact_steps"] for rs in runs.values() for r in rs),
        "summary": summary, "runs": runs, "table": text}, indent=2) + "\n")


if __name__ == "__main__":
    main()
