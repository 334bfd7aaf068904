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
import ctypes
import datetime
import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator, Optional, Sequence

import torch

from workers.weights.update import BroadcastWeights

logger = logging.getLogger(__name__)

ABORT_PREFIX = "fluxrl/weights/abort/"  # + a random name per update, known only to the group's members
_SLICE = datetime.timedelta(milliseconds=100)
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
BUCKET_BYTES = 32 * 2**20  # a bucket's size by default; an engine receives two at a time (the planner counts them)
_ALIGN = 64  # bytes: every tensor's offset in a bucket, so a byte slice can be viewed as its dtype


class WeightBroadcastError(RuntimeError):
    """A weight broadcast (or joining the group) failed: a member died, did not take
    part in time, or another member's failure aborted it. The group is then unusable."""


def default_backend() -> str:
    # NCCL needs one device per rank: with a single GPU the trainer and the engine share
    # it and NCCL refuses the duplicate device, so bytes go through host memory (gloo).
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 1 else "gloo"


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.rsplit(".", 1)[-1])


def describe_state_dict(state: dict[str, torch.Tensor], version: int,
                        bucket_bytes: int) -> tuple[dict, list[torch.Tensor]]:
    """The receive RPC's metadata and the tensors to send, in order. A tensor that is
    another one (tied embeddings) is sent once and named an alias of it."""
    entries, sources, first = [], [], {}
    for name, t in state.items():
        t = t.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), tuple(t.stride()), t.device)
        alias = first.get(key) if t.numel() else None
        entries.append([name, str(t.dtype), list(t.shape), alias])
        if alias is None:
            first[key] = name
            sources.append(t)
    return {"version": int(version), "bucket_bytes": int(bucket_bytes), "tensors": entries,
            "abort_key": new_abort_key()}, sources


def new_abort_key() -> str:
    """An abort flag's store key that nobody outside the update's RPCs can guess."""
    return ABORT_PREFIX + secrets.token_hex(16)


def new_nccl_id() -> str:
    """A fresh NCCL unique id (hex), minted by rank 0 and handed to the engines in the join
    RPC: never read back from a store (vLLM's StatelessProcessGroup would unpickle it)."""
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

    unique_id = NCCLLibrary().ncclGetUniqueId()  # its size: vLLM 0.26 has no NCCL_UNIQUE_ID_BYTES
    return ctypes.string_at(ctypes.addressof(unique_id), ctypes.sizeof(unique_id)).hex()


def _nccl_communicator(unique_id: bytes, rank: int, world_size: int, device: torch.device):
    """vLLM's ``PyNcclCommunicator`` joined from a unique id every rank was given. vLLM 0.32
    has ``PyNcclCommunicator.from_unique_id_bytes``; 0.26 lacks it, so it is built here the
    way 0.32's builds it (its body, then 0.26's ``__init__`` tail: init rank, warm-up all_reduce)."""
    from vllm.distributed.device_communicators import pynccl

    cls = pynccl.PyNcclCommunicator
    if hasattr(cls, "from_unique_id_bytes"):
        return cls.from_unique_id_bytes(unique_id, rank, world_size, device)
    comm = cls.__new__(cls)
    comm.rank, comm.world_size, comm.group = rank, world_size, None
    if world_size == 1 or pynccl.envs.VLLM_DISABLE_PYNCCL:
        comm.available, comm.disabled = False, True
        return comm
    comm.nccl = pynccl.NCCLLibrary()  # raises without NCCL, as 0.32's does
    comm.available, comm.disabled = True, False
    comm.nccl_version = comm.nccl.ncclGetRawVersion()
    comm.unique_id = comm.nccl.unique_id_from_bytes(unique_id)
    comm.device = device
    with torch.accelerator.device_index(device.index):
        comm.comm = comm.nccl.ncclCommInitRank(world_size, comm.unique_id, rank)
        data = torch.zeros(1, device=device)  # the warm-up every peer issues first
        comm.all_reduce(data)
        pynccl.current_stream().synchronize()
    return comm


def bucket_layout(meta: dict) -> list[list[tuple[int, int, int]]]:
    """Per bucket, (index among the sent tensors, byte offset, bytes): consecutive tensors
    up to ``bucket_bytes`` (a larger one alone). Trainer and engines both derive it from
    the metadata, so it never travels."""
    buckets, current, size = [], [], 0
    sent = [e for e in meta["tensors"] if e[3] is None]
    for i, (_, dtype, shape, _) in enumerate(sent):
        nbytes = _dtype(dtype).itemsize * int(torch.Size(shape).numel())
        offset = -(-size // _ALIGN) * _ALIGN
        if current and offset + nbytes > meta["bucket_bytes"]:
            buckets.append(current)
            current, offset = [], 0
        current.append((i, offset, nbytes))
        size = offset + nbytes
    if current:
        buckets.append(current)
    return buckets


def _bucket_bytes(bucket: list[tuple[int, int, int]]) -> int:
    return max(1, bucket[-1][1] + bucket[-1][2])  # an empty tensor alone still moves a byte


def _dispose(box: list) -> None:
    """Drop the group in ``box`` (its only reference) in a thread of its own: gloo's
    destructor waits for pending operations (a receive abandoned after an abort) until
    its timeout."""
    threading.Thread(target=box.clear, daemon=True, name="fluxrl-weight-group-dispose").start()


class WeightGroup:
    """This process's membership of the trainer↔engine weight group (rank 0 = trainer).
    Construction blocks until every member has joined."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 timeout_s: float = 60.0, device: Optional[torch.device] = None, *, store=None,
                 nccl_id: Optional[str] = None):
        import torch.distributed as dist

        self.rank, self.world_size, self.backend, self.timeout_s = rank, world_size, backend, timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        self._pg = self._comm = None
        self._broken = False  # a transfer failed: operations may still be pending, and destroying waits for them
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown weight broadcast backend {backend!r} (gloo or nccl)")
        if backend == "nccl" and not nccl_id:
            raise ValueError("an NCCL weight group needs the unique id rank 0 minted (host_group)")
        # rank 0 passes the store it serves (workers/io/stores.py); the others are its clients
        self.store = store if store is not None else dist.TCPStore(host, port, world_size, is_master=False,
                                                                   timeout=timeout)
        if backend == "gloo":
            self.device = torch.device("cpu")
            prefixed = dist.PrefixStore("fluxrl/weights", self.store)
            try:
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = timeout
                # a loopback rendezvous means one machine: pin gloo to loopback rather than
                # whatever the hostname resolves to
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if host in _LOOPBACK
                                 else dist.ProcessGroupGloo.create_default_device()]
                self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
            except AttributeError:  # private options gone in some torch: the public constructor
                self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            self.device = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
            try:  # the engine process pins NCCL settings for its own groups; this one is shared
                from vllm.utils.nccl import unpinned_nccl_env
            except ImportError:
                import contextlib

                unpinned_nccl_env = contextlib.nullcontext
            with unpinned_nccl_env():
                # every rank from the same id: no object exchange through the store
                self._comm = _nccl_communicator(bytes.fromhex(nccl_id), rank, world_size, self.device)

    # -- one collective ------------------------------------------------------------
    def _post(self, tensor: torch.Tensor):
        if self._comm is not None:  # NCCL: queued on the stream, waited for at the end
            self._comm.broadcast(tensor, src=0, stream=torch.cuda.current_stream(self.device))
            return None
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return self._pg.broadcast([tensor], opts)

    def _wait(self, work, aborted: Callable[[], bool]) -> None:
        if work is None:
            return
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                work.wait(_SLICE)
                return
            except RuntimeError:
                if work.is_completed():
                    # Either the operation failed (a peer crashed, gloo's timeout) or it
                    # finished just as the slice ran out ("Operation timed out!" from the
                    # wait, not from gloo): once done, a second wait returns or raises
                    # the operation's own error.
                    try:
                        work.wait(_SLICE)
                        return
                    except RuntimeError as failed:
                        raise WeightBroadcastError(f"weight broadcast failed on rank {self.rank}: {failed}") from failed
            if aborted():
                raise WeightBroadcastError(f"weight broadcast aborted on rank {self.rank}: another member failed")
            if time.monotonic() >= deadline:
                raise WeightBroadcastError(f"weight broadcast: rank {self.rank} saw no progress within "
                                           f"{self.timeout_s:g} s (a member alive but not taking part?)")

    def _sync(self) -> None:
        if self._comm is not None:
            torch.cuda.current_stream(self.device).synchronize()

    def abort_requested(self, key: str) -> bool:
        """Whether the update whose abort key is ``key`` (its metadata's) was aborted."""
        try:
            return bool(self.store.check([key]))
        except Exception:  # noqa: BLE001 - the trainer's store is gone: so is the trainer
            return True

    def abort(self, key: str) -> None:
        self.store.set(key, "1")

    # -- a whole state dict ----------------------------------------------------------
    def send(self, meta: dict, sources: Sequence[torch.Tensor], aborted: Callable[[], bool]) -> None:
        """Rank 0: the header, then the buckets, packing one while the previous ones are on
        the wire (at most two in flight, so the trainer holds one extra bucket, not a copy
        of the model)."""
        try:
            self._send(meta, sources, aborted)
        except BaseException:
            self._broken = True
            raise

    def _send(self, meta: dict, sources: Sequence[torch.Tensor], aborted: Callable[[], bool]) -> None:
        layout = bucket_layout(meta)
        header = torch.tensor([meta["version"], len(meta["tensors"]), len(layout)], dtype=torch.int64,
                              device=self.device)
        self._wait(self._post(header), aborted)
        inflight: deque = deque()
        for bucket in layout:
            first = sources[bucket[0][0]]
            if len(bucket) == 1 and first.is_contiguous() and first.device == self.device and first.numel():
                buf = first.reshape(-1).view(torch.uint8)  # alone in its bucket: sent as it is
            else:
                buf = torch.empty(_bucket_bytes(bucket), dtype=torch.uint8, device=self.device)
                for i, offset, nbytes in bucket:
                    if nbytes:
                        buf[offset: offset + nbytes].copy_(sources[i].contiguous().reshape(-1).view(torch.uint8))
            inflight.append((self._post(buf), buf))
            while len(inflight) > 2:
                self._wait(inflight.popleft()[0], aborted)
        while inflight:
            self._wait(inflight.popleft()[0], aborted)
        self._sync()

    def receive(self, meta: dict) -> dict[str, torch.Tensor]:
        """Ranks > 0: the tensors ``meta`` names, all at once, in its order (aliases share storage)."""
        got = dict(self.receive_stream(meta))
        return {name: got[name] for name, _, _, _ in meta["tensors"]}

    def receive_stream(self, meta: dict) -> Iterator[tuple[str, torch.Tensor]]:
        """Ranks > 0: (name, tensor) bucket by bucket as the bytes arrive, the next bucket
        posted while this one is handed out, so that a consumer that copies each tensor
        into its parameter and lets go of it holds two buckets, never a copy of the model.
        An alias comes right after the tensor it names (sharing its storage). The whole
        state dict must be consumed: the broadcast is one collective."""
        try:
            yield from self._receive_stream(meta)
        except BaseException:
            self._broken = True
            raise

    def _receive_stream(self, meta: dict) -> Iterator[tuple[str, torch.Tensor]]:
        layout = bucket_layout(meta)
        header = torch.zeros(3, dtype=torch.int64, device=self.device)
        key = meta["abort_key"]
        aborted = lambda: self.abort_requested(key)  # noqa: E731
        self._wait(self._post(header), aborted)
        expected = [meta["version"], len(meta["tensors"]), len(layout)]
        if header.tolist() != expected:
            raise WeightBroadcastError(f"weight broadcast out of step: the trainer sent {header.tolist()} "
                                       f"(version, tensors, buckets), this engine expected {expected}")
        sent = [e for e in meta["tensors"] if e[3] is None]
        aliases: dict[str, list[str]] = {}
        for name, _, _, alias in meta["tensors"]:
            if alias is not None:
                aliases.setdefault(alias, []).append(name)
        posted: deque = deque()
        upcoming = iter(layout)

        def post_next() -> None:
            bucket = next(upcoming, None)
            if bucket is not None:
                buf = torch.empty(_bucket_bytes(bucket), dtype=torch.uint8, device=self.device)
                posted.append((bucket, buf, self._post(buf)))  # gloo runs it as the bytes come

        post_next()
        while posted:
            bucket, buf, work = posted.popleft()
            post_next()  # before waiting: the trainer keeps two buckets on the wire
            self._wait(work, aborted)
            # NCCL: nothing waited for; the consumer's copies queue on the same stream, after it
            for i, offset, nbytes in bucket:
                name, dtype, shape, _ = sent[i]
                tensor = buf[offset: offset + nbytes].view(_dtype(dtype)).view(shape)
                yield name, tensor
                for other in aliases.get(name, ()):
                    yield other, tensor
            del buf
        self._sync()

    def close(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.destroy()
            except Exception:  # noqa: BLE001 - best effort on a broken communicator
                pass
        if self._pg is not None:
            box, self._pg = [self._pg], None
            if self._broken:
                _dispose(box)  # in a thread: it waits for the abandoned operations
            else:
                box.clear()


def host_group(host: str, world: int, backend: str, timeout_s: float,
               device: Optional[torch.device] = None) -> tuple[dict, Callable[[], WeightGroup]]:
    """Rank 0's side of a weight group: the rendezvous is bound now, to ``host`` only (its
    port is what the engines are told; bound first, so no other process can take it
    meanwhile), the group is formed by the returned call, which blocks until every member
    has joined. Returns what the engines' join RPC must carry besides host, ranks and
    timeout: ``port``, and for NCCL ``nccl_id``."""
    from workers.io.stores import master_store

    store = master_store(host, 0, world, datetime.timedelta(seconds=timeout_s))
    join = {"port": store.port}
    if backend == "nccl":
        join["nccl_id"] = new_nccl_id()
    return join, lambda: WeightGroup(host, store.port, 0, world, backend, timeout_s, device, store=store,
                                     nccl_id=join.get("nccl_id"))


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

    async def broadcast(self, state_dict: dict[str, torch.Tensor], version: int,
                        update: Optional[Callable[[Any, BroadcastWeights, int], Awaitable]] = None) -> list:
        """Send ``state_dict`` to every engine, each loading it with its update mode (keep /
        interrupt / drain) and labelling it ``version``. ``update(engine, weights, version)``
        defaults to ``engine.update_weights``; it returns the engine's ``UpdateTiming``, or
        None for an engine that died (the caller's bookkeeping). Any failure raises
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
