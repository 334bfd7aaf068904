"""The weight group of a collective weight update (workers/weights/broadcast.py): a
torch.distributed group of its own, the trainer as rank 0 and every engine worker after
it, rendezvoused on a ``TCPStore`` rank 0 serves; the update's metadata and bucket layout;
and the bucketed broadcast itself, every wait cut in slices so that a failed member's
abort reaches the others within a fraction of a second."""
from __future__ import annotations

import ctypes
import datetime
import logging
import secrets
import threading
import time
from collections import deque
from typing import Callable, Iterator, Optional, Sequence

import torch

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
