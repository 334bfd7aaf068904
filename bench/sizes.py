"""The largest model the memory planner admits, per GPU memory and layout: the Qwen2.5
family's published shapes (0.5B to 72B, sized exactly on the meta device: no weights),
planned by ``workers.cluster.placement.plan_placement`` as a run would be, with the
defaults (``model.dtype`` auto: bfloat16 on GPUs; ``trainer.micro_batch_tokens`` 4096),
with and without ``trainer.gradient_checkpointing``. Pure arithmetic: no GPU needed, and
the figures are the planner's, checked against peaks measured on an H200 only for a
0.36 B model (docs/benchmarks.md, "On a GPU").

    .venv/bin/python bench/sizes.py            # the table in docs/models.md
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.cluster.model_size import model_size  # noqa: E402
from workers.cluster.placement import Machine, PlacementError, plan_placement  # noqa: E402
from workers.spec import validate_spec  # noqa: E402

logging.basicConfig(level=logging.WARNING)

# config.json of Qwen/Qwen2.5-*: (hidden, intermediate, layers, heads, kv heads, vocabulary, tied)
QWEN25 = {
    "0.5B": (896, 4864, 24, 14, 2, 151936, True),
    "1.5B": (1536, 8960, 28, 12, 2, 151936, True),
    "3B": (2048, 11008, 36, 16, 2, 151936, True),
    "7B": (3584, 18944, 28, 28, 4, 152064, False),
    "14B": (5120, 13824, 48, 40, 8, 152064, False),
    "32B": (5120, 27648, 64, 40, 8, 152064, False),
    "72B": (8192, 29568, 80, 64, 8, 152064, False),
}

# layout -> (GPUs, the spec's resources/schedule/trainer)
LAYOUTS = {
    "disaggregated, 2 GPUs (trainer ZeRO-0, engine)": (
        2, {"resources": {"queue": "gpu", "gpus": 2}, "schedule": {"mode": "async"}}),
    "colocated, 1 GPU (engine asleep while training)": (
        1, {"resources": {"queue": "gpu", "gpus": 1, "colocate": True}, "schedule": {"mode": "sync"}}),
    "ZeRO-3 over 8 ranks, colocated, engine TP 8": (
        8, {"resources": {"queue": "gpu", "gpus": 8, "trainer_ranks": 8, "tensor_parallel": 8, "colocate": True,
                          "gpu_memory_utilization": 0.3},
            "schedule": {"mode": "sync"}, "trainer": {"zero_stage": 3}}),
}


def shapes(folder: Path) -> dict:
    sizes = {}
    for name, (h, i, layers, heads, kv, vocab, tied) in QWEN25.items():
        path = folder / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": h, "intermediate_size": i,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "vocab_size": vocab, "tie_word_embeddings": tied, "max_position_embeddings": 32768}))
        sizes[name] = model_size(str(path))
    return sizes


def largest(layout: dict, gpus: int, gib: float, sizes: dict, checkpointing: bool) -> str:
    fits = "none"
    for name, size in sizes.items():
        spec = validate_spec({"name": "sizes", "model": {"path": "m"}, "task": {"dataset": "gen:add"},
                              **{k: v for k, v in layout.items() if k != "trainer"},
                              "trainer": {**layout.get("trainer", {}), "gradient_checkpointing": checkpointing}})
        try:
            plan_placement(spec, Machine(cpu_cores=8 * gpus, gpus_per_node=gpus, gpu_memory_gib=gib), size)
        except PlacementError:
            break
        fits = name
    return fits


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", default="24,48,80,141", help="GPU memory sizes (GiB), comma-separated")
    args = p.parse_args()
    memories = [float(x) for x in args.gib.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        sizes = shapes(Path(tmp))
    print("| layout | gradient checkpointing | " + " | ".join(f"{m:g} GiB" for m in memories) + " |")
    print("|---|---|" + "---|" * len(memories))
    for label, (gpus, layout) in LAYOUTS.items():
        for checkpointing in (False, True):
            row = [largest(layout, gpus, m, sizes, checkpointing) for m in memories]
            print(f"| {label} | {'on' if checkpointing else 'off'} | " + " | ".join(row) + " |")
    print("\nparameters: " + ", ".join(f"{n} {s.params / 1e9:.2f} B" for n, s in sizes.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
