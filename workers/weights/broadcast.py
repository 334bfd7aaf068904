"""Weights from the trainer to the rollout engines over a torch.distributed collective
(``rollout.weight_transport: collective``), the way PipelineRL / OpenRLHF / vLLM's RL
examples do it, instead of safetensors bytes through the engine's RPC.

The trainer (rank 0) and every engine worker (ranks 1..N) form a group of their own,
rendezvoused on a ``TCPStore`` the trainer serves (bound to the group's host only,
workers/io/stores.py), so neither side's default torch.distributed group (DeepSpeed's
world, vLLM's) is touched: gloo through host memory on CPU, NCCL (vLLM's
``PyNcclCommunicator`` built from a unique id that rank 0 mints and the join RPC
carries) between GPUs. Nothing read from the store is ever unpickled: it holds gloo's
rendezvous and the abort flags, whose names are random per update and travel only
with the authenticated RPCs. Per update the metadata (names, dtypes, shapes, version,
abort key) travels with the engine's receive RPC; the bytes go by broadcast from rank
0, packed into buckets of consecutive tensors (one collective per tensor costs ~0.3 ms
with gloo, more than the whole tiny model takes to move). The engine side is
``WeightSyncExtension.fluxrl_join_weight_group`` / ``fluxrl_receive_weights``
(workers/weights/sync.py).

Failure: every wait is cut in slices so that a member that fails makes the others
fail within a fraction of a second (the update's abort key in the store) instead of at
the group's timeout; the timeout itself catches a member that is alive but never joins
the broadcast. A failed group is broken for good: ``open`` it again with the live engines.
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Sequence

import torch

from workers.weights.update import BroadcastWeights
from workers.weights.weight_group import (BUCKET_BYTES, WeightBroadcastError, WeightGroup, default_backend,
                                          describe_state_dict, host_group)

logger = logging.getLogger(__name__)


class LocalSender:
    """Rank 0 of the weight group in this process: the tensors it is given are sent from here."""

    def __init__(self, device: Optional[torch.device] = None):
        self.device = device
        self.group: Optional[WeightGroup] = None
        self._form: Optional[Callable[[], WeightGroup]] = None
        self._sources: Sequence[torch.Tensor] = ()
        self._abort_key: Optional[str] = None

    def host(self, host: str, world: int, backend: str, timeout_s: float) -> dict:
        self.close()
        join, self._form = host_group(host, world, backend, timeout_s, self.device)
        return join

    def form(self) -> None:
        self.group = self._form()

    def prepare(self, state_dict: Optional[dict[str, torch.Tensor]], version: int, bucket_bytes: int) -> dict:
        meta, self._sources = describe_state_dict(state_dict, version, bucket_bytes)
        self._abort_key = meta["abort_key"]
        return meta

    def send(self, meta: dict, aborted: Callable[[], bool]) -> None:
        try:
            self.group.send(meta, self._sources, aborted)
        finally:
            self._sources = ()

    def abort(self) -> None:
        if self._abort_key is not None:
            self.group.abort(self._abort_key)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class RankZeroSender:
    """Rank 0 of the weight group is trainer rank 0's own process (workers/train/rank_process.py):
    the weights go from where they are gathered straight to the engines, never through
    this process. ``trainer`` is a ``TrainerGroup`` (or ``ClusterTrainer``) holding global
    rank 0; ``prepare`` is a collective of every rank (ZeRO-3 gathers)."""

    def __init__(self, trainer, timeout_s: float = 60.0):
        self.trainer, self.timeout_s = trainer, timeout_s
        self.host_addr: Optional[str] = None
        self._store = None  # a client of rank 0's store: the abort flag
        self._port: Optional[int] = None
        self._abort_key: Optional[str] = None

    def host(self, host: str, world: int, backend: str, timeout_s: float) -> dict:
        self.host_addr, self._store = host, None
        join = self.trainer.host_weight_group(host, world, backend, timeout_s)
        self._port = join["port"]
        return join

    def form(self) -> None:
        import torch.distributed as dist

        self.trainer.form_weight_group()
        self._store = dist.TCPStore(self.host_addr, self._port, is_master=False, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=self.timeout_s))

    def prepare(self, state_dict, version: int, bucket_bytes: int) -> dict:
        meta = self.trainer.prepare_weights(version, bucket_bytes)
        self._abort_key = meta["abort_key"]  # rank 0 minted it with the metadata
        return meta

    def send(self, meta: dict, aborted: Callable[[], bool]) -> None:
        error = self.trainer.send_weights()  # rank 0 watches the update's abort flag in its store itself
        if error is not None:
            raise WeightBroadcastError(f"trainer rank 0: {error}")

    def abort(self) -> None:
        if self._store is not None and self._abort_key is not None:
            self._store.set(self._abort_key, "1")

    def close(self) -> None:
        self._store = None
        try:
            self.trainer.leave_weight_group()
        except Exception:  # noqa: BLE001 - a failed trainer has no group to leave
            pass


@dataclass
class CollectiveWeights:
    """One broadcast as an engine sees it: the metadata for its receive RPC, and a barrier
    every engine passes right before sending that RPC. The trainer sends once all have
    passed, so no receive waits long for the bytes (in drain mode an engine may wait
    for its requests far longer than the group's timeout)."""
    meta: dict
    members: int
    _arrived: int = 0
    _open: asyncio.Event = field(default_factory=asyncio.Event)
    _failed: Optional[BaseException] = None
    go: threading.Event = field(default_factory=threading.Event)  # for the trainer's sending thread

    async def arrive(self) -> None:
        self._arrived += 1
        if self._arrived >= self.members:
            self._open.set()
            self.go.set()
        await self._open.wait()
        if self._failed is not None:
            raise WeightBroadcastError(f"weight broadcast abandoned: {self._failed}")

    def fail(self, why: BaseException) -> None:
        if self._failed is None:
            self._failed = why
        self._open.set()


class WeightBroadcaster:
    """The trainer's side: ``await open(engines)`` once (and again after a failure, with
    the live engines), ``await broadcast(state_dict, version)`` per update, ``close()``.
    Rank 0 of the group is this process (``LocalSender``, the default) or trainer rank 0's
    (``RankZeroSender``: ``broadcast(None, version)`` then sends what that rank holds)."""

    def __init__(self, host: str = "127.0.0.1", backend: Optional[str] = None, timeout_s: float = 60.0,
                 bucket_bytes: int = BUCKET_BYTES, device: Optional[torch.device] = None, sender=None):
        self.host, self.backend, self.timeout_s = host, backend or default_backend(), timeout_s
        self.bucket_bytes = int(bucket_bytes)
        self.sender = sender or LocalSender(device)
        self.engines: list = []
        self.opened = False
        self.last_send_ms: Optional[float] = None  # the trainer's side of the last broadcast
        # Engines hash what they receive in host memory; on a GPU only when asked (the resume check)
        self.digest_next = False

    @property
    def group(self) -> Optional[WeightGroup]:
        """This process's membership (a local sender's), if any."""
        return getattr(self.sender, "group", None)

    async def open(self, engines: Sequence) -> None:
        """Form the group with ``engines`` (RolloutEngine): the trainer's rendezvous in a
        thread while each engine's workers join through their RPC."""
        self.close()
        engines = list(engines)
        counts = [e.worker_count for e in engines]
        world = 1 + sum(counts)
        join = await asyncio.to_thread(self.sender.host, self.host, world, self.backend, self.timeout_s)
        port = join["port"]
        trainer = asyncio.ensure_future(asyncio.to_thread(self.sender.form))
        offsets = [1 + sum(counts[:i]) for i in range(len(engines))]
        # the join RPC (authenticated) carries the NCCL id: engines never read it from the store
        extra = {"nccl_id": join["nccl_id"]} if join.get("nccl_id") else {}
        joins = await asyncio.gather(*(e.join_weight_group(dict(
            host=self.host, port=port, rank_offset=off, world_size=world, backend=self.backend,
            timeout_s=self.timeout_s, **extra)) for e, off in zip(engines, offsets)), return_exceptions=True)
        failed = [(e.index, r) for e, r in zip(engines, joins) if isinstance(r, BaseException)]
        if failed:
            # the trainer's rendezvous fails on its own at the timeout; nobody waits for it
            trainer.add_done_callback(lambda t: t.cancelled() or (t.exception() is None and self.sender.close()))
            raise WeightBroadcastError(f"rollout engine {failed[0][0]} could not join the weight group: "
                                       f"{type(failed[0][1]).__name__}: {failed[0][1]}") from failed[0][1]
        try:
            await trainer
        except Exception as exc:
            raise WeightBroadcastError(f"the trainer could not form the weight group: {exc}") from exc
        self.engines, self.opened = engines, True
        logger.info("weight group open: %s, %d rank(s) on %s:%d", self.backend, world, self.host, port)

    async def broadcast(self, state_dict: Optional[dict[str, torch.Tensor]], version: int,
                        update: Optional[Callable[[Any, BroadcastWeights, int], Awaitable]] = None) -> list:
        """Send ``state_dict`` (None: a ``RankZeroSender`` gathers it) to every engine, each
        loading it with its update mode (keep / interrupt / drain) and labelling it
        ``version``. ``update(engine, weights, version)`` defaults to
        ``engine.update_weights``; it returns the engine's ``UpdateTiming``, or None for an
        engine that died (the caller's bookkeeping). Any failure raises
        ``WeightBroadcastError`` after every member has stopped, and breaks the group."""
        if not self.opened:
            raise WeightBroadcastError("the weight group is not open (WeightBroadcaster.open)")
        update = update or (lambda engine, weights, v: engine.update_weights(weights, v))
        source = self.sender
        meta = await asyncio.to_thread(source.prepare, state_dict, version, self.bucket_bytes)
        if self.digest_next:
            meta, self.digest_next = {**meta, "digest": True}, False
        weights = CollectiveWeights(meta, members=len(self.engines))
        aborted = threading.Event()
        loop = asyncio.get_running_loop()

        def abort(why: BaseException) -> None:  # from the loop's thread or the sending one
            if not aborted.is_set():
                aborted.set()
                try:
                    source.abort()
                except Exception:  # noqa: BLE001 - the engines then stop at their timeout
                    pass
            loop.call_soon_threadsafe(weights.fail, why)

        def send() -> float:
            while not weights.go.wait(0.05):
                if aborted.is_set():
                    raise WeightBroadcastError("weight broadcast abandoned before it began")
            t0 = time.perf_counter()
            try:
                source.send(meta, aborted.is_set)
            except BaseException as exc:
                abort(exc)
                raise
            return (time.perf_counter() - t0) * 1000

        def settled(task: asyncio.Task) -> None:
            if task.cancelled():
                abort(RuntimeError("cancelled"))
            elif task.exception() is not None:
                abort(task.exception())
            elif task.result() is None:
                abort(RuntimeError("a rollout engine died"))

        sender = asyncio.ensure_future(asyncio.to_thread(send))
        tasks = [asyncio.ensure_future(update(e, BroadcastWeights(weights), version)) for e in self.engines]
        for task in tasks:
            task.add_done_callback(settled)
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
            if any(isinstance(r, BaseException) or r is None for r in results):
                abort(RuntimeError("an engine failed"))
            try:
                # the thread notices the abort within one wait slice (NCCL: never, see close)
                self.last_send_ms = await asyncio.wait_for(asyncio.shield(sender), timeout=self.timeout_s)
                send_error = None
            except BaseException as exc:  # noqa: BLE001 - reported below with the engines' errors
                send_error = exc
        except BaseException as exc:  # cancelled: the others must not wait for us
            abort(exc)
            raise
        errors = [(e.index, r) for e, r in zip(self.engines, results) if isinstance(r, BaseException)]
        dead = [e.index for e, r in zip(self.engines, results) if r is None]
        if errors or dead or send_error is not None:
            self.close()
            parts = ([f"rollout engine(s) {dead} died"] if dead else []) + \
                    [f"rollout engine {i}: {type(r).__name__}: {r}" for i, r in errors] + \
                    ([f"trainer: {type(send_error).__name__}: {send_error}"] if send_error is not None else [])
            first = next((r for _, r in errors), send_error)
            raise WeightBroadcastError(f"weight broadcast of version {version} failed: " + "; ".join(parts)) from first
        return results

    def close(self) -> None:
        if self.opened or isinstance(self.sender, LocalSender):
            self.sender.close()
        self.opened = False
        self.engines = []
