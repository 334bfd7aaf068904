"""LoRA RL against full fine-tuning on the zoo Qwen2 (docs/guides/lora.md): the same chat
sums task, schedule and steps, one run each in one invocation, printed side by side:
held-out greedy accuracy over time (step, seconds since the first evaluation, accuracy),
the trainer's peak resident memory (its own process: resources.trainer_process), and each
weight update's bytes (weights/update_bytes against weights/model_bytes) and milliseconds
(weights/sync_ms: from the call to the engine's acknowledgement, and weights/load_ms: the
engine's load), medians over the run.

    .venv/bin/python bench/lora.py --steps 150
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from pathlib import Path

from sync_vs_async import ROOT, run_cli

logger = logging.getLogger("lora")

# lr: full fine-tuning as the zoo test trains it (docs/models.md); the adapter starts at B = 0
# and takes a larger one, as LoRA does elsewhere
MODES = {
    "full": {"algorithm": {"lr": 1e-4}},
    "lora": {"model": {"lora": {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}},
             "algorithm": {"lr": 5e-4}},
}


def spec_for(mode: str, model: str, data: str, steps: int, every: int) -> dict:
    over = MODES[mode]
    return {
        "name": f"bench-lora-{mode}", "model": {"path": model, **over.get("model", {})},
        "task": {"dataset": data, "eval_size": 200},
        "reward": {"function": "numeric_match"},
        "algorithm": {"loss": "ppo", "group_size": 8, "warmup_steps": 2, "adv_std_norm": True, **over["algorithm"]},
        "rollout": {"max_tokens": 16, "temperature": 1.0, "update_mode": "keep"},
        "schedule": {"mode": "async", "max_staleness": 2, "batch_prompts": 16},
        "stop": {"max_steps": steps, "max_minutes": 20},
        "eval": {"every_steps": every, "prompts": 200},
        "resources": {"trainer_process": True},
    }


def one_run(mode: str, model: str, data: str, steps: int, every: int, workdir: Path) -> dict:
    result, points, wall = run_cli(spec_for(mode, model, data, steps, every), workdir, mode)

    def series(key):
        return [p for p in points if p["key"] == key]

    evals = sorted(series("eval/accuracy"), key=lambda p: p["step"])
    t0 = evals[0]["time"]
    trainer_peak = {k: v for k, v in (result.get("memory_peak_gib") or {}).items() if k.startswith("trainer")}
    return {
        "mode": mode, "steps": result["steps"], "wall_s": round(wall, 1),
        "accuracy": [(p["step"], round(p["time"] - t0, 1), p["value"]) for p in evals],
        "trainer_peak_gib": max(trainer_peak.values()) if trainer_peak else None,
        "update_bytes": statistics.median(p["value"] for p in series("weights/update_bytes")),
        "model_bytes": series("weights/model_bytes")[-1]["value"],
        "sync_ms": round(statistics.median(p["value"] for p in series("weights/sync_ms")), 2),
        "load_ms": round(statistics.median(p["value"] for p in series("weights/load_ms")), 2),
    }


def table(rows: list[dict]) -> str:
    lines = [f"{'':28}" + "".join(f"{r['mode']:>22}" for r in rows)]

    def line(label, values):
        lines.append(f"{label:28}" + "".join(f"{v:>22}" for v in values))

    line("steps / wall s", [f"{r['steps']} / {r['wall_s']}" for r in rows])
    line("trainer peak RSS (GiB)", [str(r["trainer_peak_gib"]) for r in rows])
    line("update bytes", [f"{int(r['update_bytes']):,}" for r in rows])
    line("  share of the model", [f"{r['update_bytes'] / r['model_bytes']:.2%}" for r in rows])
    line("update sync ms (median)", [str(r["sync_ms"]) for r in rows])
    line("update load ms (median)", [str(r["load_ms"]) for r in rows])
    for k in range(max(len(r["accuracy"]) for r in rows)):
        cells = []
        for r in rows:
            step, seconds, acc = r["accuracy"][k] if k < len(r["accuracy"]) else ("", "", None)
            cells.append(f"{acc:.3f} @ {seconds:.0f}s" if acc is not None else "")
        line(f"held-out acc, step {rows[0]['accuracy'][k][0] if k < len(rows[0]['accuracy']) else ''}", cells)
    return "\n".join(lines)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--every", type=int, default=25, help="steps between held-out evaluations")
    ap.add_argument("--modes", default="full,lora")
    ap.add_argument("--lora-lr", type=float, default=None, help="the LoRA run's lr (default: MODES['lora'])")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lora.json"))
    args = ap.parse_args()
    from workers.models.modelzoo import ensure_zoo_model
    from workers.models.zoo_data import write_chat_dataset

    if args.lora_lr:
        MODES["lora"]["algorithm"]["lr"] = args.lora_lr
    model = str(ensure_zoo_model("qwen2"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="fluxrl-bench-lora-") as tmp:
        data = str(write_chat_dataset(Path(tmp) / "chat.jsonl", 1500, seed=7, two_digit=True))
        for mode in args.modes.split(","):
            rows.append(one_run(mode, model, data, args.steps, args.every, Path(tmp)))
            logger.info("%s", json.dumps(rows[-1]))
    logger.info("\n%s", table(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
