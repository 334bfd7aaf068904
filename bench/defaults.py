"""Does the default spec learn as well as its alternatives on models FluxRL did not build?
The question: with ``algorithm.minibatches`` left to its default (2 for ``ppo``), a
Qwen2 folder with its own tokenizer learned sums worse than with ``minibatches: 1``.

Each configuration (``--values``: what ``algorithm.minibatches`` is set to, ``default``
leaving it out; ``2+lr=2.5e-5`` also sets other algorithm fields, to study why one wins)
trains each model (``--models``: the zoo's ``qwen2``, ``llama`` and ``gpt2``, ``external``:
bench/external_model.py's Qwen2 with a 64-id character tokenizer, built apart from the zoo's
code, and any model folder given by path) at each seed, interleaved, on
a chat task of sums with a 2-digit operand: lr 5e-5, 8 prompts x 8 samples a step, async
with max staleness 2, ``--steps`` steps, everything else as the spec's defaults have it
(``--base user``, a new user's run) or as examples/add-async.yaml has it (``--base
example``); then the held-out greedy accuracy on 200 prompts. The table gives, per model and
configuration, the median final accuracy over the seeds (and each seed's), and whether
``default`` is within 0.03 of ``1`` (the bar).

    .venv/bin/python bench/defaults.py [--models qwen2,llama,gpt2,external,/path/to/folder] [--seeds 0,1]
                                       [--values default,1] [--steps 150] [--base user|example]
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

logger = logging.getLogger("defaults")
BAR = 0.03  # how far below minibatches 1 the default may end


def stem(model: str, value: str, seed: int) -> str:
    """A run's name part: ``qwen2-2-lr2.5e-5-s0``."""
    return f"{Path(model).name}-{value.replace('+', '-').replace('=', '')}-s{seed}"


def diagnostics(points: list[dict]) -> dict:
    """What says why a configuration learns as it does: the held-out accuracy at each eval,
    and over the run's steps the mean share of tokens whose ratio the clip bound and of
    those the behaviour-weight cap dropped, and the mean entropy."""
    def mean(key: str):
        values = [p["value"] for p in points if p["key"] == key]
        return round(statistics.fmean(values), 4) if values else None

    return {"curve": [[p["step"], p["value"]] for p in points if p["key"] == "eval/accuracy"],
            "clip_frac": mean("policy/clip_frac"), "behav_dropped_frac": mean("policy/behav_dropped_frac"),
            "entropy": mean("policy/entropy")}


BASES = ("user", "example")


def spec_for(model: str, value: str, seed: int, steps: int, data: Path, base: str = "user") -> dict:
    """The run of ``model`` in configuration ``value``. ``base`` ``user``: the spec's own
    defaults for everything a new user does not set (a constant lr after a 10-step
    warm-up); ``example``: examples/add-async.yaml's (the lr decayed linearly to 0, no warm-up)."""
    from workers.models.modelzoo import ARCHS, ensure_zoo_model

    if model == "external":
        from external_model import ensure_external_model

        path = str(ensure_external_model())
    else:
        path = str(ensure_zoo_model(model, progress=True)) if model in ARCHS else model
    if base == "example":
        spec = yaml.safe_load((ROOT / "examples" / "add-async.yaml").read_text())
        spec["algorithm"].pop("minibatches", None)
        algorithm = {"lr": 5e-5, "group_size": 8, "warmup_steps": 0}
    else:
        spec = {"reward": {"function": "numeric_match"}}
        algorithm = {"lr": 5e-5, "group_size": 8}
    minibatches, *overrides = value.split("+")
    if minibatches != "default":
        algorithm["minibatches"] = int(minibatches)
    for override in overrides:  # "lr=2.5e-5": one algorithm field changed, to find out why one setting wins
        key, _, number = override.partition("=")
        algorithm[key] = float(number)
    return merged(spec, {"name": f"defaults-{stem(model, value, seed)}", "seed": seed,
                         "model": {"path": path}, "task": {"dataset": str(data), "size": 4000, "eval_size": 200},
                         "algorithm": algorithm, "rollout": {"max_tokens": 16},
                         "schedule": {"mode": "async", "max_staleness": 2, "batch_prompts": 8},
                         "stop": {"max_steps": steps, "max_minutes": 60},
                         "eval": {"every_steps": max(1, steps // 3), "prompts": 200}})


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen2,llama,gpt2")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--values", default="default,1", help="algorithm.minibatches per configuration ('default': unset; "
                    "'2+clip=100': other algorithm fields too)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--base", choices=BASES, default="user",
                    help="user: the spec's defaults besides the settings above; example: examples/add-async.yaml's")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "defaults.json"))
    args = ap.parse_args()
    from workers.models.zoo_data import write_chat_dataset

    models, seeds, values = args.models.split(","), [int(s) for s in args.seeds.split(",")], args.values.split(",")
    configs = [f"{m}|{v}|{s}" for m in models for s in seeds for v in values]
    with tempfile.TemporaryDirectory(prefix="fluxrl-defaults-") as tmp:
        data = write_chat_dataset(Path(tmp) / "sums.jsonl", 4400, two_digit=True)

        def one(config: str, tag: str) -> dict:
            model, value, seed = config.split("|")
            result, points, wall = run_cli(spec_for(model, value, int(seed), args.steps, data, args.base), Path(tmp),
                                           stem(model, value, int(seed)))
            row = {"model": model, "value": value, "seed": int(seed), "steps": result["steps"],
                   "accuracy_before": result["accuracy_before"], "accuracy_after": result["accuracy_after"],
                   "wall_s": round(wall, 1), **diagnostics(points)}
            logger.info("%s", row)
            return row

        runs = interleaved(configs, 1, one)
    rows = [r for rs in runs.values() for r in rs]
    table = {}
    print(f"\n{'model':>12} {'minibatches':>11} {'final accuracy, median (each seed)':>36}")
    for model in models:
        for value in values:
            finals = [r["accuracy_after"] for r in rows if r["model"] == model and r["value"] == value]
            table[(model, value)] = statistics.median(finals)
            print(f"{Path(model).name:>12} {value:>11} {table[(model, value)]:>10.3f} "
                  f"({', '.join(f'{f:.3f}' for f in finals)})")
        if "default" in values and "1" in values:
            gap = table[(model, "1")] - table[(model, "default")]
            print(f"{'':>12} default vs 1: {-gap:+.3f} ({'within' if gap <= BAR else 'NOT within'} {BAR})")
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": rows}, indent=2))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
