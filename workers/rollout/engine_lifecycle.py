"""The vLLM engine under a :class:`~workers.rollout.engine.RolloutEngine`: the arguments it
starts with, its calls with deadlines (a dead or wedged core fails them instead of hanging),
sleep and wake-up on colocated plans, and its shutdown. A base of ``RolloutEngine``
(through :class:`~workers.rollout.engine_updates.EngineUpdates`), whose ``__init__`` sets
the state declared here."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Optional

from workers.rollout.engine_args import asleep_after_wake, lora_engine_args, resolve_enforce_eager, vllm_on_cpu
from workers.rollout.engine_types import EngineDied, EngineRPCTimeout

logger = logging.getLogger(__name__)


class EngineLifecycle:
    # set by RolloutEngine.__init__
    engine: Any  # vLLM's AsyncLLM, once started
    index: int
    model_path: str
    dtype: str
    max_model_len: int
    max_num_seqs: int
    seed: int
    rpc_timeout_s: float
    enforce_eager: Optional[bool]
    tensor_parallel: int
    priority_scheduling: bool
    gpu_memory_utilization: Optional[float]
    sleep_mode: bool
    asleep: Optional[str]
    lora_rank: Optional[int]
    lora_slots: int
    _lora_folder: Optional[str]

    # -- lifecycle ---------------------------------------------------------------
    def engine_args(self, on_cpu: Optional[bool] = None):
        """The AsyncEngineArgs this engine starts vLLM with (building them starts nothing).
        ``on_cpu``: default, vLLM's platform."""
        from vllm.engine.arg_utils import AsyncEngineArgs

        eager = resolve_enforce_eager(self.enforce_eager, vllm_on_cpu() if on_cpu is None else on_cpu)
        return AsyncEngineArgs(
            model=self.model_path, dtype=self.dtype, max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
            enforce_eager=eager, seed=self.seed, disable_log_stats=True,
            worker_extension_cls="workers.weights.sync.WeightSyncExtension",
            # behaviour log-probs of the distribution actually sampled from (after temperature)
            logprobs_mode="processed_logprobs",
            # a cached prefix computed with old weights would leak into new requests
            enable_prefix_caching=False,
            # one shard: the worker in the engine core process; more: vLLM's worker processes
            tensor_parallel_size=self.tensor_parallel,
            distributed_executor_backend="uni" if self.tensor_parallel == 1 else "mp",
            # vLLM checks the platform (CUDA, ROCm, XPU) and turns its cumem allocator on
            **({"enable_sleep_mode": True} if self.sleep_mode else {}),
            **({"scheduling_policy": "priority"} if self.priority_scheduling else {}),
            **({"gpu_memory_utilization": self.gpu_memory_utilization} if self.gpu_memory_utilization else {}),
            **(lora_engine_args(self.lora_rank, self.lora_slots) if self.lora_rank else {}),
        )

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self._lora_folder is not None:
            import shutil

            shutil.rmtree(self._lora_folder, ignore_errors=True)
            self._lora_folder = None

    @property
    def dead(self) -> bool:
        """Its engine core process died (vLLM then raises EngineDeadError for new calls)."""
        return self.engine is None or bool(getattr(self.engine, "errored", False))

    def core_pids(self) -> list[int]:
        """Pids of the engine core processes (one with the uni executor)."""
        resources = getattr(getattr(self.engine, "engine_core", None), "resources", None)
        manager = getattr(resources, "engine_manager", None)
        return [proc.pid for proc in getattr(manager, "processes", [])]

    async def _call(self, what: str, aw, timed: bool = True):
        """Await an engine call, failing with ``EngineDied`` once the engine is dead and with
        ``EngineRPCTimeout`` after ``rpc_timeout_s``. vLLM (0.32, AsyncMPClient) never
        resolves a utility call that is pending when the core process dies: the future
        stays in ``utility_results`` forever, so without this a weight update hangs."""
        task = asyncio.ensure_future(aw)
        deadline = time.monotonic() + (self.rpc_timeout_s if timed else math.inf)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=max(0.0, min(0.05, deadline - time.monotonic())))
                if done:
                    return task.result()
                if self.dead:
                    raise EngineDied(f"rollout engine {self.index} died during {what}")
                if time.monotonic() >= deadline:
                    raise EngineRPCTimeout(f"rollout engine {self.index} did not answer {what} within "
                                           f"{self.rpc_timeout_s:g} s (rollout.rpc_timeout_s); it looks wedged")
        finally:
            if not task.done():
                task.cancel()
                task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning

    # -- colocated plans: asleep while the trainer steps ---------------------------------
    async def sleep(self) -> float:
        """Free this engine's GPU memory for the trainer's step: vLLM's sleep level 1 (the
        weights offloaded to host memory, the KV cache discarded; vllm/v1/worker/gpu_worker.py
        ``sleep``). Level 1, not 2: a woken engine holds exactly the weights it slept with,
        whatever the next update sends. The sync schedule calls it after its generation
        barrier, so nothing is running (vLLM would abort it). Returns the seconds it took."""
        if not self.sleep_mode:
            raise RuntimeError(f"rollout engine {self.index} was started without sleep mode")
        t = time.perf_counter()
        await self._call("sleep", self.engine.sleep(level=1))
        self.asleep = "all"
        return time.perf_counter() - t

    async def wake_up(self, tags: Optional[list[str]] = None) -> float:
        """Wake what sleeps: ``["weights"]`` first, so that an update lands in them while the
        KV cache still sleeps (the weight-receive buffers fit where it was), then the rest
        (``None``). vLLM resumes scheduling once all of it is back. Returns the seconds."""
        if self.asleep is None:
            return 0.0
        left = asleep_after_wake(self.asleep, tags)
        t = time.perf_counter()
        # what sleeps follows what was asked, once vLLM has done it: its answer differs by
        # version (0.26 returns None, later ones whether everything is awake)
        answer = await self._call("wake_up", self.engine.wake_up(tags))
        if isinstance(answer, bool) and answer != (left is None):
            logger.warning("rollout engine %d: vLLM says %s after waking %s; %s sleeps as asked",
                           self.index, "all awake" if answer else "not all awake", tags or "everything",
                           left or "nothing")
        self.asleep = left
        return time.perf_counter() - t
