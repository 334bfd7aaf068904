"""The trainer path on whatever accelerator this machine has, in one command: DeepSpeed
rank processes (NCCL on GPUs, gloo on the CPU), ZeRO 2 and 3, bf16 on GPUs, the KL
reference on the ranks' device, the gathered full weights (checksummed) and their
export over the collective to a receiver in another process.

    .venv/bin/python bench/gpu_trainer.py            # every check, a table at the end
    .venv/bin/python bench/gpu_trainer.py --steps 5 --stages 2 3 --ranks 2
    .venv/bin/python bench/gpu_trainer.py --stages 0 1 2 3 --dtype bfloat16   # precision per stage
    .venv/bin/python bench/gpu_trainer.py --model PATH --stages 2                 # another model folder
    .venv/bin/python bench/gpu_trainer.py --write-05b DIR [--like ZOO_QWEN2]    # a 0.5B-shaped model

Devices: rank r trains on GPU r (its process sees the ranks' GPUs and takes
cuda:LOCAL_RANK among them, as DeepSpeed's launcher does: workers/train/ranks.py); the weight export's sender is cuda:0 of this
process and its receiver cuda:1 of another (NCCL wants one device per member), each made
the process's current device. Every store is bound once: the trainer world's by rank 0,
the export's by host_group (port 0, the kernel's choice, read back).

vLLM is not needed (a receiving WeightGroup stands in for an engine's worker), so it
runs where vLLM cannot be installed. One rank per GPU (``--ranks``, default: every GPU,
or 2 on the CPU); with one GPU the export is not run (NCCL wants a device per member) and
says so. Exit code 0 only if every check that ran held.
"""
from __future__ import annotations

import argparse
import logging
import math
import multiprocessing as mp
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from workers.cluster.model_size import model_size  # noqa: E402
from workers.cluster.trainer_memory import trainer_rank_peak_gib  # noqa: E402
from workers.spec import validate_spec  # noqa: E402
from workers.models.tinymodel import encode, ensure_tiny_model  # noqa: E402
from workers.train.samples import TrainSample  # noqa: E402
from workers.train.ranks import TrainerGroup  # noqa: E402
from workers.weights.weight_group import WeightGroup, default_backend, describe_state_dict, host_group  # noqa: E402
from workers.weights.sync import tensors_checksum  # noqa: E402

log = logging.getLogger("gpu_trainer")


def _spec(stage: int, dtype: str) -> dict:
    return validate_spec({
        "name": f"gpu-zero{stage}", "model": {"path": "builtin:tiny", "dtype": dtype},
        "task": {"dataset": "gen:add"}, "algorithm": {"lr": 1e-4, "kl_coef": 0.05, "warmup_steps": 0,
                                                       # one optimiser step a batch: the first step's KL is
                                                       # the start's, 0 (with two, the second minibatch's is not)
                                                       "minibatches": 1},
        "trainer": {"zero_stage": stage, "micro_batch_tokens": 256},
    })


def _batch(step: int, n: int = 16) -> list[TrainSample]:
    gen = torch.Generator().manual_seed(step)
    batch = []
    for i in range(n):
        prompt = encode(f"{i + step}+{2 * i}=")
        tokens = torch.randint(3, 14, (4 + i % 5,), generator=gen).tolist()
        batch.append(TrainSample(prompt, tokens, [-1.0] * len(tokens), float(i % 3 - 1)))
    return batch


def _device(rank: int):
    # NCCL wants one device per rank: the receiver must not share cuda:0 with the sender
    return torch.device("cuda", rank) if default_backend() == "nccl" else None


def _use(device) -> None:
    if device is not None:  # what NCCL and current-stream calls without a device then use
        torch.cuda.set_device(device)


def _receive(join: dict, world: int, meta: dict, queue) -> None:
    _use(_device(1))
    group = WeightGroup("127.0.0.1", join["port"], 1, world, default_backend(), 60.0, _device(1),
                        nccl_id=join.get("nccl_id"))
    queue.put(tensors_checksum(group.receive(meta)))
    group.close()


def _export(state: dict, version: int) -> tuple[bool, float]:
    """Broadcast the state to a receiver process; (checksums agree, ms)."""
    _use(_device(0))
    join, form = host_group("127.0.0.1", 2, default_backend(), 60.0, _device(0))  # one bound store, one port
    meta, sources = describe_state_dict(state, version, 32 * 2**20)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_receive, args=(join, 2, meta, queue))
    child.start()
    try:
        group = form()
        t0 = time.perf_counter()
        group.send(meta, sources, lambda: False)
        received = queue.get(timeout=120)
        ms = (time.perf_counter() - t0) * 1000
        group.close()
    finally:
        child.join(60)
    return received == tensors_checksum(state), ms


class PeakGpuMemory:
    """The most memory any one GPU held (``nvidia-smi``, every 0.2 s) while in the block,
    in GiB: the ranks are processes of their own, so this process's allocator cannot say.
    It counts what the planner leaves out (the CUDA context, NCCL's buffers, activations)."""

    def __init__(self):
        self.gib: Optional[float] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout.split()
            except (OSError, subprocess.SubprocessError):
                return
            if out:
                self.gib = max(self.gib or 0.0, max(float(x) for x in out) / 1024)

    def __enter__(self) -> "PeakGpuMemory":
        if torch.cuda.is_available() and shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def write_qwen2_05b(dst: Path, like: Optional[Path] = None) -> Path:
    """A model of Qwen2.5-0.5B's shape (24 layers, hidden 896, 14/2 heads; random bf16
    weights: nothing can be downloaded) in ``dst``. With ``like`` (a zoo qwen2 folder) it
    takes that folder's vocabulary, special ids and tokenizer files, so an engine can serve
    it; without, a 2048-token vocabulary, enough for the trainer alone."""
    import transformers

    small = transformers.AutoConfig.from_pretrained(like) if like else None
    cfg = transformers.Qwen2Config(
        vocab_size=small.vocab_size if small else 2048, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=small.bos_token_id if small else 1, eos_token_id=small.eos_token_id if small else 2,
        pad_token_id=small.pad_token_id if small else 0)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    log.warning("%.2f B parameters -> %s", sum(p.numel() for p in model.parameters()) / 1e9, dst)
    model.save_pretrained(dst, safe_serialization=True)
    for f in Path(like).iterdir() if like else ():  # the tokenizer and generation files
        if f.is_file() and not f.name.startswith(("model", "config", "fluxrl_zoo")):
            shutil.copy(f, dst / f.name)
    return dst


def run_stage(model: str, stage: int, ranks: int, steps: int, dtype: Optional[str] = None) -> dict:
    gpu = torch.cuda.is_available()
    dtype = dtype or ("bfloat16" if gpu else "float32")
    spec = _spec(stage, dtype)
    devices = [str(i) for i in range(ranks)] if gpu else None
    size = model_size(model)
    row = {"stage": stage, "ranks": ranks, "dtype": dtype, "backend": "nccl" if gpu else "gloo",
           "params_M": round(size.params / 1e6, 1) if size else None,
           # the planner's figure for a rank (workers/cluster/memory.py), against the peak measured below
           "planned_gib": round(trainer_rank_peak_gib(spec, size, ranks, dtype), 2) if size else None}
    t0 = time.perf_counter()
    with PeakGpuMemory() as peak, TrainerGroup(spec, model, ranks, None if gpu else 1, 0,
                                               cuda_devices=devices) as group:
        first = tensors_checksum(group.state_dict())
        losses, kls = [], []
        for step in range(steps):
            stats = group.train_step(_batch(step))
            losses.append(stats["loss/policy"])
            kls.append(stats["loss/kl"])
        state = group.state_dict()
        row |= {
            "steps": steps, "version": group.version, "seconds": round(time.perf_counter() - t0, 1),
            "finite": all(math.isfinite(x) for x in losses + kls),
            "kl_first": kls[0], "kl_last": kls[-1],
            "kl_after_first": kls[-1] > 0 and kls[0] == 0,  # the reference is the start, on the ranks' device
            "weights_changed": tensors_checksum(state) != first,
            "full_tensors": all(t.numel() > 0 for t in state.values()),
        }
        row["peak_gib"] = None if peak.gib is None else round(peak.gib, 2)
        if gpu and torch.cuda.device_count() < 2:  # NCCL: one device per member, never two on one GPU
            row["export_ok"], row["export_ms"] = None, None
        else:
            row["export_ok"], row["export_ms"] = _export(state, group.version)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    p.add_argument("--ranks", type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="model.dtype (default: bfloat16 on GPUs, float32 on the CPU)")
    p.add_argument("--model", default=None, help="a model folder (default: the tiny model); the batches' token ids "
                                                 "are the tiny model's, valid in any vocabulary of 14 or more")
    p.add_argument("--write-05b", metavar="DIR", type=Path, default=None,
                   help="only write a model of Qwen2.5-0.5B's shape (random weights) to DIR, then exit")
    p.add_argument("--like", metavar="ZOO_FOLDER", type=Path, default=None,
                   help="with --write-05b: take this zoo qwen2 folder's vocabulary and tokenizer")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.write_05b:
        write_qwen2_05b(args.write_05b, args.like)
        return 0
    gpu = torch.cuda.is_available()
    ranks = args.ranks or (torch.cuda.device_count() if gpu else 2)
    model = args.model or str(ensure_tiny_model(progress=False))
    print(f"device: {torch.cuda.get_device_name(0) if gpu else 'cpu'} x{torch.cuda.device_count() if gpu else 0}, "
          f"torch {torch.__version__}, {ranks} rank(s)")
    if gpu and ranks > torch.cuda.device_count():
        p.error(f"--ranks {ranks}: one GPU per rank, {torch.cuda.device_count()} visible")
    rows = [run_stage(model, stage, ranks, args.steps, args.dtype) for stage in args.stages]
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(f"{row[k]:.3g}" if isinstance(row[k], float) else str(row[k]) for k in keys))
    checks = ("finite", "kl_after_first", "weights_changed", "full_tensors", "export_ok")
    ok = all(row[c] for row in rows for c in checks if row[c] is not None)  # None: not measurable here
    if any(row["export_ok"] is None for row in rows):
        print("export: not run (one GPU: the NCCL export needs a device for each member)")
    print("all checks held" if ok else "A CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
