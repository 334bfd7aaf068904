"""Does the demo's learning signal come from learning? The demo spec cut to N steps,
beside two runs that cannot learn, measured by the same held-out greedy accuracy:

  working   examples/add-async.yaml as it is
  lr0       the same with a learning rate of 1e-12 (the spec refuses 0): the engine runs
            every step, the weights cannot move
  random    the same with a reward that is a coin flip, blind to the answer

Each final model is evaluated a second time, independently of the engine (plain HF
generation, no vLLM). The demo test's threshold (tests/workers/cli/test_cli.py,
DEMO_MIN_GAIN) is set between the broken runs and the working ones measured here.

  .venv/bin/python bench/learning_control.py --steps 250 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

import yaml

from sync_vs_async import ROOT, interleaved, merged, run_cli

logger = logging.getLogger("learning_control")

COIN_FLIP = ("import random\n"
             "def reward(prompt, completion, **fields):\n"
             "    return float(random.random() < 0.5)\n")
VARIANTS = {
    "working": {},
    "lr0": {"algorithm": {"lr": 1e-12}},
    "random": {"reward": {"function": "user", "code": COIN_FLIP}},
}


def independent_accuracy(spec: dict, model_dir: Path) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from workers.tasks.datasets import load_rows
    from workers.models.tinymodel import greedy_accuracy

    torch.set_num_threads(1)
    task = spec["task"]
    _, held_out = load_rows(task["dataset"], task["size"], task["eval_size"], task.get("seed", 0))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return greedy_accuracy(model, held_out[: spec["eval"]["prompts"]], max_new=spec["rollout"]["max_tokens"])


def one_run(name: str, tag: str, steps: int, workdir: Path) -> dict:
    base = yaml.safe_load((ROOT / "examples" / "add-async.yaml").read_text())
    spec = merged(merged(base, VARIANTS[name]), {"name": f"control-{name}",
                                                  "stop": {"max_steps": steps, "max_minutes": 30},
                                                  "eval": {"every_steps": steps}})
    result, _, wall = run_cli(spec, workdir, f"{name}-{tag}")
    out = workdir / f"{name}-{tag}"
    row = {"variant": name, "steps": result["steps"], "wall_s": round(wall, 1),
           "accuracy_before": result["accuracy_before"], "accuracy_after": result["accuracy_after"],
           "gain": round(result["accuracy_after"] - result["accuracy_before"], 4),
           "independent_after": independent_accuracy(spec, out / "final_model")}
    logger.info("%s", row)
    return row


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "learning_control.json"))
    args = ap.parse_args()
    names = args.variants.split(",")
    with tempfile.TemporaryDirectory(prefix="fluxrl-control-") as tmp:
        runs = interleaved(names, args.rounds, lambda name, tag: one_run(name, tag, args.steps, Path(tmp)))
    print(f"\n{'variant':10} {'gains (engine)':28} {'after, independent':24}")
    for name in names:
        gains = ", ".join(f"{r['gain']:+.4f}" for r in runs[name])
        after = ", ".join(f"{r['independent_after']:.4f}" for r in runs[name])
        print(f"{name:10} {gains:28} {after:24}")
    Path(args.out).write_text(json.dumps({"steps": args.steps, "runs": runs}, indent=2))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
