"""What loading under ``deepspeed.zero.Init`` saves in host memory at ZeRO-3
(``workers.train.deepspeed_setup.partitioned_loading``, used by the trainer for the policy
and the critic).

Two arms, each a fresh world of ``--ranks`` CPU processes (gloo), one after the other in one
invocation: each rank builds the model from its folder and hands it to
``deepspeed.initialize`` with the trainer's own ZeRO-3 config and a torch AdamW, as
``Trainer.__init__`` does, once under ``partitioned_loading`` (zero.Init) and once plainly.
Each rank reports its resident memory after the load and its peak (VmHWM) after
``deepspeed.initialize``; the table gives the per-rank mean of each arm and their ratio.

    .venv/bin/python bench/zero_init.py [--model real-size] [--ranks 2] [--dtype bfloat16]

``--model real-size``: Qwen2.5-0.5B's shape, built once under $FLUXRL_MODEL_CACHE; ``tiny``:
the tiny model. No GPU: on GPUs the same saving applies to host memory while loading.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

logger = logging.getLogger("bench.zero_init")
GIB = 2**30


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _rank(rank: int, world: int, port: int, model_path: str, dtype: str, partitioned: bool, out) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"})
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    from workers.spec import validate_spec
    from workers.train.deepspeed_setup import deepspeed_config, init_distributed, partitioned_loading

    torch.set_num_threads(1)
    spec = validate_spec({"name": "zero-init", "model": {"path": model_path, "dtype": dtype},
                          "task": {"dataset": "gen:add"}, "trainer": {"zero_stage": 3}})
    init_distributed()
    config = deepspeed_config(spec, device="cpu")
    load = getattr(torch, dtype)  # ZeRO-3 in bf16/fp32: the spec's dtype (no autocast above ZeRO 0)
    with partitioned_loading(config) if partitioned else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=load)
    loaded = _status_kib("VmRSS")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    out.put({"rank": rank, "loaded_gib": loaded / 2**20, "peak_gib": _status_kib("VmHWM") / 2**20,
             "after_initialize_gib": _status_kib("VmRSS") / 2**20})
    torch.distributed.barrier()


def _arm(model_path: str, ranks: int, dtype: str, partitioned: bool) -> list[dict]:
    import multiprocessing

    from workers.io.ports import free_port

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_rank, args=(r, ranks, port, model_path, dtype, partitioned, out))
             for r in range(ranks)]
    for p in procs:
        p.start()
    rows = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(timeout=300)
        if p.exitcode != 0:
            raise RuntimeError(f"a rank exited with {p.exitcode}")
    return sorted(rows, key=lambda r: r["rank"])


def _model(name: str) -> str:
    if name == "tiny":
        from workers.models.tinymodel import ensure_tiny_model

        return str(ensure_tiny_model(progress=False))
    from workers.models.realsize import ensure_shaped_model

    return str(ensure_shaped_model("qwen2.5-0.5b"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("real-size", "tiny"), default="real-size")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = _model(args.model)
    arms = {}
    for name, partitioned in (("zero.Init", True), ("plain load", False)):
        logger.info("%s: %d ranks, ZeRO-3 %s, %s", name, args.ranks, args.dtype, path)
        arms[name] = _arm(path, args.ranks, args.dtype, partitioned)
    mean = {name: {k: sum(r[k] for r in rows) / len(rows) for k in ("loaded_gib", "peak_gib", "after_initialize_gib")}
            for name, rows in arms.items()}
    lines = ["arm          | RSS after load GiB | peak to initialize GiB | RSS after initialize GiB (per rank, mean)"]
    for name, m in mean.items():
        lines.append(f"{name:12s} | {m['loaded_gib']:18.2f} | {m['peak_gib']:22.2f} | {m['after_initialize_gib']:.2f}")
    a, b = mean["zero.Init"], mean["plain load"]
    lines.append(f"{'ratio':12s} | {a['loaded_gib'] / b['loaded_gib']:17.2f}x | {a['peak_gib'] / b['peak_gib']:21.2f}x | "
                 f"{a['after_initialize_gib'] / b['after_initialize_gib']:.2f}x")
    logger.info("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "model": path, "ranks": arms, "mean": mean},
                                              indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
