"""vLLM's settings for a rollout engine (workers/rollout/engine.py): the CPU backend's
environment, eager mode, LoRA slots and rank classes, request priority, the arguments of a
worker's file load, and what sleeps after a partial wake-up."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from workers.weights.files import WeightFile


def configure_cpu_environment(threads_bind: Optional[str], kv_cache_gb: float) -> None:
    """vLLM's CPU backend reads these when its engine process starts."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(kv_cache_gb)))))
    if threads_bind:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def resolve_enforce_eager(setting: Optional[bool], on_cpu: bool) -> bool:
    """rollout.enforce_eager: None means eager on the CPU (vLLM's CPU platform would otherwise
    torch.compile the model at start-up, minutes on a small machine, and has no CUDA graphs:
    platforms/cpu.py) and CUDA graphs on GPUs (vLLM's default: decode steps replayed as graphs;
    weight updates keep them valid, reload_weights copies in place)."""
    return on_cpu if setting is None else bool(setting)


LORA_ID, LORA_NAME = 1, "fluxrl-policy"  # model.lora: the policy's adapter in vLLM


def lora_rank_class(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts at or above ``rank``."""
    from workers.spec import VLLM_LORA_RANKS

    return next(r for r in VLLM_LORA_RANKS if r >= rank)


def lora_engine_args(rank: int, slots: int = 1) -> dict:
    """vLLM's LoRA settings for adapters up to ``rank``: ``slots`` adapters at once (one,
    the run's; a shared pool's, one per run), a max_lora_rank vLLM accepts at or above it."""
    return {"enable_lora": True, "max_loras": slots, "max_cpu_loras": slots, "max_lora_rank": lora_rank_class(rank)}


def vllm_on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def priority_kwargs(priority: int) -> dict:
    """vLLM's ``priority`` argument, left out at 0 (the default, the only value an engine
    without priority scheduling accepts)."""
    return {"priority": priority} if priority else {}


def identity_args(weights: "WeightFile") -> tuple:
    """(identity, size) for a worker's file load: the file as checked, which the worker
    reads only if its path still names it (files.held_weight_file); plain values, as
    vLLM's RPC encodes them."""
    return (list(weights.identity), weights.size) if weights.identity is not None else (None, None)


SLEEP_TAGS = ("weights", "kv_cache")  # what vLLM's sleep level 1 puts to sleep, and wake_up's tags


def asleep_after_wake(asleep: Optional[str], tags: Optional[list[str]]) -> Optional[str]:
    """What still sleeps after waking ``tags`` (None: everything) of an engine where
    ``asleep`` sleeps ("all", one of ``SLEEP_TAGS``, or None when awake): "all", one tag, or
    None once nothing does."""
    unknown = [t for t in tags or [] if t not in SLEEP_TAGS]
    if unknown:
        raise ValueError(f"unknown wake_up tags {unknown}: vLLM's are {list(SLEEP_TAGS)}")
    if asleep is None or tags is None:
        return None
    sleeping = set(SLEEP_TAGS) if asleep == "all" else {asleep}
    left = sleeping - set(tags)
    if not left:
        return None
    return "all" if left == set(SLEEP_TAGS) else left.pop()
