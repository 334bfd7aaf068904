"""How a trainer's DeepSpeed engines are set up: the config a spec trains under (precision by
``model.dtype`` and ZeRO stage), the process group on a store we bind ourselves, and models
built partitioned at ZeRO-3 (``deepspeed.zero.Init``), so no rank ever holds a whole copy."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch

from workers.spec import RunSpec, model_dtype


class PrecisionError(ValueError):
    """A model.dtype this device cannot train, with what to use instead."""


AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}

# DeepSpeed 0.19.8's dynamic loss scaling (deepspeed/runtime/constants.py FP16_*): start at
# 2^16, halve on an overflowing step (the step is skipped), double after 1000 clean ones.
FP16_LOSS_SCALING = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                     "min_loss_scale": 1}


def deepspeed_config(spec: RunSpec, *, fp16_supported: bool = True, device: str = "cuda",
                     zero_stage: Optional[int] = None) -> dict:
    """The DeepSpeed config a spec trains under (no DeepSpeed started; tested as is).

    Precision, by ``model.dtype`` and ``trainer.zero_stage``:

    - float32: no mixed precision.
    - bfloat16 / float16 at ZeRO 1-3: DeepSpeed's ``bf16`` / ``fp16`` mode (fp16 with dynamic
      loss scaling), fp32 master weights, and gradients accumulated over the micro-batches in
      fp32 (``data_types.grad_accum_dtype``: at stage 1 bf16 that selects BF16_Optimizer,
      engine.py _do_optimizer_sanity_check; stages 2 and 3 accumulate their partitions in it).
    - bfloat16 / float16 at ZeRO 0: ``torch_autocast`` (fp32 parameters, gradients and AdamW,
      matmuls in the low precision; float16 adds DeepSpeed's GradScaler). DeepSpeed 0.19.8 has
      no fp32 accumulation without ZeRO (bf16 params with grad_accum_dtype fp32 raise
      NotImplementedError there), and its bf16 mode alone would sum micro-batch gradients in bf16.

    Refused (``PrecisionError``): float16 at ZeRO 1-3 where the accelerator has no fp16
    (DeepSpeed's CPU accelerator: only where oneDNN has fp16), which DeepSpeed would refuse with
    "Type fp16 is not supported on your device".

    ``zero_stage``: another engine's stage (the critic's, workers/train/critic.py).
    """
    algo, dtype = spec.algorithm, model_dtype(spec)
    stage = spec.trainer.zero_stage if zero_stage is None else zero_stage
    config: dict = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,  # we mark accumulation boundaries ourselves
        "gradient_clipping": algo.grad_clip,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    if dtype == "float32":
        return config
    if stage == 0:
        config["torch_autocast"] = {"enabled": True, "dtype": dtype}
        return config
    if dtype == "float16" and not fp16_supported:
        raise PrecisionError(
            f"model.dtype float16 with trainer.zero_stage {stage}: DeepSpeed's {device} accelerator has no fp16 "
            "here (its fp16 mode needs a GPU). Use model.dtype bfloat16 (same memory, no loss scaling) or "
            "float32, or trainer.zero_stage 0 (fp16 autocast over fp32 weights)")
    if dtype == "bfloat16":
        config["bf16"] = {"enabled": True}
    else:
        config["fp16"] = {"enabled": True, **FP16_LOSS_SCALING}
    config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def forget_earlier_autocast() -> None:
    """DeepSpeed 0.19.8 records torch_autocast in module globals (runtime/torch_autocast.py:
    TORCH_AUTOCAST_INITIALIZED/_DTYPE) that no later engine resets, and its ZeRO optimizers
    read them: after an fp16-autocast engine, a plain fp32 engine in the same process would
    take fp16 communication and loss-scaling paths. Each engine starts from a clean slate;
    deepspeed.initialize sets them again when this config enables autocast."""
    from deepspeed.runtime import torch_autocast

    torch_autocast.TORCH_AUTOCAST_INITIALIZED = False
    torch_autocast.TORCH_AUTOCAST_DTYPE = None


def init_distributed() -> None:
    import deepspeed

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not torch.cuda.is_available():
        # No shared-memory all-reduce on gloo ranks: DeepSpeed uses it only for inference
        # all-reduce (training goes through torch.distributed either way), and it would JIT-build
        # the op under a lock file in ~/.cache/torch_extensions; a process killed during the
        # build leaves the lock behind, and every later run then waits on it forever.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not torch.distributed.is_initialized():
        init_world(backend)
    # DeepSpeed finds the group initialised and only wraps it (deepspeed/comm/comm.py)
    deepspeed.init_distributed(dist_backend=backend)


def init_world(backend: str) -> None:
    """The DeepSpeed world's process group, on a store we bind ourselves: env:// would make
    rank 0's store listen on every interface, open to anyone on the network."""
    import torch.distributed as dist
    from deepspeed.constants import default_pg_timeout

    from workers.io.stores import interface_of, is_loopback, master_store

    addr, rank, world = os.environ["MASTER_ADDR"], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world == 1:
        # A single process is its own rendezvous: an in-memory store, no socket at all
        # (several runs share a machine, and a parent that trained in-process holds ports).
        store = dist.HashStore()
    elif rank == 0:
        store = master_store(addr, int(os.environ["MASTER_PORT"]), world, default_pg_timeout)
    else:
        store = dist.TCPStore(addr, int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=default_pg_timeout)
    if backend == "gloo" and world > 1 and is_loopback(addr) and "GLOO_SOCKET_IFNAME" not in os.environ:
        # One machine: gloo's own pair sockets (of this group and DeepSpeed's later ones) on
        # loopback too, not on whatever the hostname resolves to. Only in a rank's process,
        # whose environment is its own; one in-process trainer has no peer to listen for.
        interface = interface_of(addr)
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    kwargs = {}
    if backend == "nccl" and world > 1:  # as DeepSpeed's own init does: bind the group to this rank's device
        kwargs["device_id"] = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=default_pg_timeout,
                            **kwargs)


MMAP_THRESHOLD_ENV = "FLUXRL_TRAINER_MMAP_THRESHOLD_KB"
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def limit_heap_fragmentation() -> bool:
    """Allocations over ``FLUXRL_TRAINER_MMAP_THRESHOLD_KB`` (1024; 0 leaves glibc's default)
    go to their own mappings, returned to the system when freed. glibc's default threshold
    rises after each freed mapping, up to 32 MB, so a training step's activations of a few MB
    land in the heap, whose holes later steps of other sizes cannot reuse: measured on
    Qwen2.5-0.5B's shape (bfloat16 over fp32 weights, sync, 10 steps on a 24 GB machine) the
    trainer's process grew 9 → 12 → 15 → 20 GB until the OOM killer ended the run at step 6;
    with a fixed 1 MiB threshold it stayed between 6.4 and 10 GB. Fixing the threshold also
    turns off that rise. Returns whether it was set (glibc only)."""
    import ctypes
    import ctypes.util

    kb = int(os.environ.get(MMAP_THRESHOLD_ENV, "1024"))
    name = ctypes.util.find_library("c")
    if kb <= 0 or not name:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, kb * 1024))


@contextlib.contextmanager
def partitioned_loading(config: dict) -> Iterator[None]:
    """Models built inside are partitioned as they are built and loaded, when ``config`` is a
    ZeRO-3 one (transformers' ``from_pretrained`` under ``deepspeed.zero.Init``). What it
    saves is GPU memory: DeepSpeed 0.19.8 moves a module that was not built so onto the
    rank's device whole before partitioning it (engine.py ``_configure_distributed_model``),
    so a model larger than one GPU could not be loaded at all. Host memory: no saving
    (measured on the CPU, bench/zero_init.py: 0.94x after the load, 1.06-1.15x at the peak,
    since a plain load maps the safetensors lazily). Other stages: nothing changes. Only the
    models DeepSpeed will train belong inside (a frozen reference is used as a plain module)."""
    if config.get("zero_optimization", {}).get("stage") != 3:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    hold = HfDeepSpeedConfig(config)  # transformers keeps only a weak reference to it
    try:
        yield
    finally:
        del hold
        unset_hf_deepspeed_config()
