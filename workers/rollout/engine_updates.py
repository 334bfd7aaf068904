"""A :class:`~workers.rollout.engine.RolloutEngine`'s weight updates: the load of each kind
of update (weights/update.py), the label vLLM stamps each output step with, the update modes
(the module docstring of engine.py) and the generation stall an update costs. A base of
``RolloutEngine``, whose ``__init__`` sets the state declared here."""
from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from typing import TYPE_CHECKING, Optional

from workers.rollout.engine_args import LORA_NAME, identity_args
from workers.rollout.engine_lifecycle import EngineLifecycle
from workers.rollout.engine_types import EngineDied, EngineRPCTimeout, UpdateTiming
from workers.weights.update import BroadcastWeights, FileWeights, InlineWeights, WeightUpdate

if TYPE_CHECKING:
    from workers.weights.files import WeightFile


class EngineUpdates(EngineLifecycle):
    # set by RolloutEngine.__init__
    update_mode: str
    version: int
    lora_id: int
    lora_request: Optional[object]  # vLLM's LoRARequest, once the first adapter is loaded
    _update_lock: Optional[asyncio.Lock]
    active: dict[str, float]
    updates: list[UpdateTiming]
    _resume: asyncio.Event
    _interrupted: set[str]
    _grouped: set[str]
    _gap_ema: Optional[float]
    _pending_stall: Optional[tuple[UpdateTiming, float, dict[str, float]]]

    # -- weight updates ------------------------------------------------------------
    @property
    def worker_count(self) -> int:
        """Its vLLM workers (ranks it takes in a weight group): its tensor-parallel shards."""
        parallel = getattr(getattr(self.engine, "vllm_config", None), "parallel_config", None)
        return int(getattr(parallel, "world_size", 1) or 1)

    async def join_weight_group(self, info: dict) -> list[int]:
        """Join the trainer's weight group (workers/weights/broadcast.py); returns the ranks
        of its workers. Blocks until every member has joined, so the trainer's side must
        run meanwhile."""
        return await self._call("joining the weight group",
                                self.engine.collective_rpc("fluxrl_join_weight_group", kwargs=info))

    def _load(self, weights: WeightUpdate):
        """The load of one update, by what it is (the one place an engine tells them apart):
        an awaitable of each worker's report."""
        if isinstance(weights, FileWeights) and weights.adapter != bool(self.lora_rank):
            raise ValueError(f"rollout engine {self.index} serves "
                             f"{'a LoRA adapter (model.lora)' if self.lora_rank else 'full weights'}: it cannot "
                             f"load {'an adapter' if weights.adapter else 'full weights'}")
        if self.lora_rank and not isinstance(weights, FileWeights):
            raise TypeError("model.lora: an adapter update comes as a weight file (rollout.weight_transport rpc)")
        if isinstance(weights, FileWeights) and weights.adapter:
            return self._load_adapter(weights.file)
        if isinstance(weights, FileWeights):  # read by vLLM's workers a tensor at a time
            return self.engine.collective_rpc("fluxrl_load_weight_file", args=(weights.file.path, False,
                                                                                *identity_args(weights.file)))
        if isinstance(weights, InlineWeights):
            return self.engine.collective_rpc("fluxrl_load_weights", args=(weights.data,))
        return self.engine.collective_rpc("fluxrl_receive_weights", args=(weights.group.meta,))

    async def _load_adapter(self, weights: "WeightFile") -> list[dict]:
        """model.lora: the adapter file into vLLM's LoRA slot, in place (the worker's
        ``fluxrl_load_lora_file``). The first one also becomes the adapter every request
        generates with from then on (before it, the base model: the same policy, B = 0)."""
        if self._lora_folder is None:
            import tempfile

            self._lora_folder = tempfile.mkdtemp(prefix=f"fluxrl-lora-e{self.index}-")
        name = f"{LORA_NAME}-{self.lora_id}"
        loaded = await self.engine.collective_rpc("fluxrl_load_lora_file",
                                                  args=(weights.path, self._lora_folder, self.lora_id, name,
                                                        *identity_args(weights)))
        if self.lora_request is None:
            from vllm.lora.request import LoRARequest

            self.lora_request = LoRARequest(name, self.lora_id, loaded[0]["folder"])
        return loaded

    # -- what a run on a shared engine changes (workers/rollout/pool.py) --------------------
    def policy_version(self, label: int) -> int:
        """The policy version behind the label vLLM stamped a token with: the same number,
        on an engine of one run."""
        return label

    def engine_label(self, version: int) -> int:
        """The label vLLM stamps tokens with once this engine holds ``version``."""
        return version

    def _set_label(self, label: str):
        """Have the engine stamp its next output steps ``label`` (awaitable). vLLM 0.26 has
        no weight versions (``set_weight_version``, ``CompletionOutput.weight_versions``;
        0.32 has both): there the outputs carry none and each is labelled with
        ``self.version`` as it arrives (``seen`` in ``extend_track``)."""
        core = self.engine.engine_core
        if hasattr(core, "set_weight_version_async"):
            return core.set_weight_version_async(label)
        return asyncio.sleep(0)

    async def update_weights(self, weights: WeightUpdate, version: int) -> UpdateTiming:
        """Load new weights, labelled ``version``, with the engine's update mode: ``weights``
        says how they come (weights/update.py): a safetensors file (the RPC path),
        safetensors bytes, or a broadcast the trainer runs meanwhile (weights/broadcast.py).
        On a shared engine one run's update at a time (a pause and resume of another's would
        land in the middle of it)."""
        async with (self._update_lock or contextlib.nullcontext()):
            return await self._update_weights(weights, version)

    async def _update_weights(self, weights: WeightUpdate, version: int) -> UpdateTiming:
        core = self.engine.engine_core
        label = str(self.engine_label(version))
        t0 = time.perf_counter()
        group = weights.group if isinstance(weights, BroadcastWeights) else None
        collective = group is not None
        if group is not None and self.update_mode != "drain":
            await group.arrive()  # every engine is about to receive: the trainer sends now
        if self.update_mode == "keep" and collective:
            # The version is set only once the receive succeeded (one more round trip while
            # paused): a broken broadcast leaves the old weights, which keep their label.
            try:
                _, loaded = await self._call("a weight update", asyncio.gather(
                    core.pause_scheduler_async(mode="keep", clear_cache=False), self._load(weights)))
            except Exception as exc:
                await self._resume_after(exc)
                raise
            await self._call("a weight version", asyncio.gather(self._set_label(label),
                                                                 core.resume_scheduler_async()))
        elif self.update_mode == "keep":
            _, loaded, _, _ = await self._call("a weight update", asyncio.gather(
                core.pause_scheduler_async(mode="keep", clear_cache=False),
                self._load(weights),
                self._set_label(label),
                core.resume_scheduler_async(),
            ))
        elif self.update_mode == "interrupt":
            self._resume.clear()
            try:
                # only requests of their own: group requests are refused in this mode
                victims = [key for key in self.active if key not in self._grouped]
                self._interrupted.update(victims)
                await self._call("an abort", self.engine.abort(victims))
                loaded = await self._call("a weight load", self._load(weights))
                await self._call("a weight version", self._set_label(label))
            finally:
                self._resume.set()
        elif self.update_mode == "drain":
            # waits for the running requests: as long as they take, but not past a death
            await self._call("a drain", core.pause_scheduler_async(mode="wait", clear_cache=False), timed=False)
            try:
                if group is not None:  # the other engines may still be draining: wait for them untimed
                    await group.arrive()
                loaded = await self._call("a weight load", self._load(weights))
                await self._call("a weight version", self._set_label(label))
            except Exception as exc:
                if collective:
                    await self._resume_after(exc)
                raise
            await self._call("a resume", core.resume_scheduler_async())
        else:
            raise ValueError(f"unknown update mode {self.update_mode!r}")
        self.version = version
        timing = UpdateTiming(version, (time.perf_counter() - t0) * 1000, loaded[0]["load_ms"])
        self.updates.append(timing)
        if self.update_mode == "keep" and self.active:
            # Stall as the requests see it: the gap across the update minus a usual gap.
            self._pending_stall = (timing, time.perf_counter(), {r: t for r, t in self.active.items()})
        return timing

    async def _resume_after(self, exc: Exception) -> None:
        """After a failed broadcast the engine is fine and must not stay paused; a dead or
        wedged one is not worth another call."""
        if not isinstance(exc, (EngineDied, EngineRPCTimeout)) and not self.dead:
            with contextlib.suppress(Exception):
                await self._call("a resume", self.engine.engine_core.resume_scheduler_async())

    def _note_output(self, rid: str) -> None:
        now = time.perf_counter()
        last = self.active.get(rid, now)
        gap = now - last
        self.active[rid] = now
        pending = self._pending_stall
        if pending is not None and rid in pending[2]:
            timing, _, before = pending
            if before.pop(rid) == last and self._gap_ema is not None:
                timing.stall_samples.append(max(0.0, (gap - self._gap_ema) * 1000))
            if not before or len(timing.stall_samples) >= 8:
                timing.gen_stall_ms = statistics.median(timing.stall_samples) if timing.stall_samples else None
                self._pending_stall = None
            return
        self._gap_ema = gap if self._gap_ema is None else 0.9 * self._gap_ema + 0.1 * gap

    async def weights_checksum(self) -> Optional[str]:
        """The checksum of the state dict its last update loaded, the same in every shard
        (each tensor-parallel worker takes the whole update and keeps its slice)."""
        sums = await self._call("a checksum", self.engine.collective_rpc("fluxrl_loaded_checksum"))
        if len(set(sums)) > 1:
            raise RuntimeError(f"rollout engine {self.index}: its {len(sums)} shards loaded different weights: {sums}")
        return sums[0]
