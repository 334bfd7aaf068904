"""The trainer as N DeepSpeed ranks, each in its own process: data parallel at any
ZeRO stage (gloo on the CPU, NCCL on GPUs), a drop-in for ``Trainer`` in the controller.

``TrainerGroup`` starts this node's ranks (multiprocessing *spawn*) and talks to them
over pipes with typed messages (``TrainerRequest`` / ``TrainerReply``). Several groups
with the same master address and port, one per node, form one world.

The objective is that of one ``Trainer`` on the whole batch. The parent plans every
optimiser step for the whole world: each step's samples are split over the ranks by
tokens, the loss denominator is the whole step's, and each rank scales its gradients
by the world size because DeepSpeed *averages* them over ranks (mean of W·g_r/D =
Σ g_r / D). Every rank runs the same number of forward/backward passes per step (idle
passes fill up), since ZeRO-2/3 communicate in each of them.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Annotated, Literal, NoReturn, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from workers.io.lifetime import exit_with_parent
from workers.io.ports import free_port
from workers.spec import RunSpec

if TYPE_CHECKING:  # torch and DeepSpeed load in a rank only after its environment is set
    import torch

    from workers.train.trainer import Trainer, TrainSample
    from workers.weights.files import WeightFile

log = logging.getLogger(__name__)

_POLL_S = 0.5  # how often a waiting parent looks again
_SHUTDOWN_GRACE_S = 10.0


class TrainerRankError(RuntimeError):
    """A rank process died or raised; the group is unusable (its other ranks are stopped)."""

    def __init__(self, message: str, rank: Optional[int] = None, exitcode: Optional[int] = None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


# -- messages ------------------------------------------------------------------------
class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Sample(_Message):
    prompt_ids: list[int]
    token_ids: list[int]
    behav_logprobs: list[float]
    advantage: float
    prox_logprobs: Optional[list[float]] = None
    reward: float = 0.0  # algorithm.advantage gae: each rank's critic turns it into per-token advantages
    values: Optional[list[float]] = None  # critic.forward stage: the critic's values, from the inference stage
    ref_logprobs: Optional[list[float]] = None  # algorithm.kl_reference stage: log π_ref, from the inference stage


class StepShare(_Message):
    """One rank's part of one optimiser step."""
    samples: list[int]  # indices into the request's samples
    denominator: float  # of the whole step, over all ranks
    micro_batches: int  # the most any rank packs in this step


class TrainRequest(_Message):
    kind: Literal["train"] = "train"
    samples: list[Sample]  # every sample this rank trains on in this batch
    steps: list[StepShare]
    proximal_micro_batches: int = 0  # several steps: π_prox of ``proximal`` first, in this many forwards
    proximal: list[int] = []  # indices into ``samples``: those a step after the first trains on
    critic_micro_batches: int = 0  # gae: the critic's values of ``samples`` first, in this many forwards
    # gae: indices into ``samples`` whose advantages this rank counts in the batch's statistics
    # (whitening, critic/*): with several epochs a sample trains on more than one rank, and is
    # counted on one of them only; None counts all of ``samples``
    counted: Optional[list[int]] = None
    grad_scale: float


class BeginStepRequest(_Message):
    kind: Literal["begin_step"] = "begin_step"


class AccumulateRequest(_Message):
    kind: Literal["accumulate"] = "accumulate"
    samples: list[Sample]
    denominator: float
    last: bool
    micro_batches: int
    grad_scale: float


class FinishStepRequest(_Message):
    kind: Literal["finish_step"] = "finish_step"
    sequences: int
    rescale: bool
    denominator: Optional[float]  # of the whole streamed step over all ranks


class StateDictRequest(_Message):
    kind: Literal["state_dict"] = "state_dict"
    model: Literal["policy", "critic"] = "policy"  # critic: for the critic stage (workers/train/value_stage.py)
    path: Optional[str] = None  # rank 0 writes a safetensors file there (node 0's disk) instead of replying a blob


class SaveRequest(_Message):
    kind: Literal["save"] = "save"
    path: str


class SaveStateRequest(_Message):
    kind: Literal["save_state"] = "save_state"
    folder: str


class LoadStateRequest(_Message):
    kind: Literal["load_state"] = "load_state"
    folder: str


class ShutdownRequest(_Message):
    kind: Literal["shutdown"] = "shutdown"


# The weight group (workers/weights/broadcast.py) with global rank 0 as its rank 0: the
# weights go from the rank that gathers them straight to the engines.
class HostWeightGroupRequest(_Message):
    kind: Literal["host_weight_group"] = "host_weight_group"
    host: str
    world: int
    backend: str
    timeout_s: float


class FormWeightGroupRequest(_Message):
    kind: Literal["form_weight_group"] = "form_weight_group"


class PrepareWeightsRequest(_Message):
    kind: Literal["prepare_weights"] = "prepare_weights"  # every rank: ZeRO-3 gathers
    version: int
    bucket_bytes: int


class SendWeightsRequest(_Message):
    kind: Literal["send_weights"] = "send_weights"


class LeaveWeightGroupRequest(_Message):
    kind: Literal["leave_weight_group"] = "leave_weight_group"


TrainerRequest = Annotated[
    Union[TrainRequest, BeginStepRequest, AccumulateRequest, FinishStepRequest, StateDictRequest, SaveRequest,
          SaveStateRequest, LoadStateRequest, ShutdownRequest, HostWeightGroupRequest, FormWeightGroupRequest,
          PrepareWeightsRequest, SendWeightsRequest, LeaveWeightGroupRequest],
    Field(discriminator="kind"),
]


class ReadyReply(_Message):
    kind: Literal["ready"] = "ready"
    rank: int
    pid: int
    version: int


class DoneReply(_Message):
    kind: Literal["done"] = "done"
    rank: int
    version: int


class StatsReply(_Message):
    kind: Literal["stats"] = "stats"
    rank: int
    version: int
    stats: dict[str, Union[int, float]]  # reduced over all ranks: every rank sends the same


class StateReply(_Message):
    kind: Literal["state"] = "state"
    rank: int
    blob: Optional[bytes] = None  # safetensors bytes of the full state dict, from global rank 0 only
    checksum: Optional[str] = None  # tensors_checksum of it, computed in rank 0


class WeightGroupReply(_Message):
    """Rank 0 on the weight group. ``error``: the group failed (not the rank: it trains on)."""
    kind: Literal["weight_group"] = "weight_group"
    rank: int
    port: Optional[int] = None
    nccl_id: Optional[str] = None  # NCCL: the unique id rank 0 minted, for the engines' join RPC
    meta: Optional[dict] = None
    error: Optional[str] = None


class ErrorReply(_Message):
    kind: Literal["error"] = "error"
    rank: int
    error: str
    traceback: str


TrainerReply = Annotated[
    Union[ReadyReply, DoneReply, StatsReply, StateReply, WeightGroupReply, ErrorReply],
    Field(discriminator="kind"),
]

_REQUESTS: TypeAdapter = TypeAdapter(TrainerRequest)
_REPLIES: TypeAdapter = TypeAdapter(TrainerReply)


class _RankConfig(_Message):
    spec: RunSpec
    model_path: str
    threads: Optional[int]
    pad_id: int
    rank: int
    parent_pid: int
    env: dict[str, str]


# -- planning (parent side) --------------------------------------------------------------
def _length(s) -> int:
    return len(s.prompt_ids) + len(s.token_ids)


def split_by_tokens(indices: list[int], lengths: list[int], parts: int) -> list[list[int]]:
    """Longest first onto the least-loaded part: shares balanced by (unpadded) tokens."""
    loads, out = [0] * parts, [[] for _ in range(parts)]
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        r = min(range(parts), key=lambda r: (loads[r], r))
        out[r].append(i)
        loads[r] += lengths[i]
    return [sorted(o) for o in out]


def _micro_batches(share: list[int], lengths: list[int], budget: int) -> int:
    from workers.train.algorithms import pack_first_fit_decreasing

    return len(pack_first_fit_decreasing([lengths[i] for i in share], budget))


def _sample(s) -> Sample:
    prox = None if s.prox_logprobs is None else list(s.prox_logprobs)
    return Sample(prompt_ids=list(s.prompt_ids), token_ids=list(s.token_ids), behav_logprobs=list(s.behav_logprobs),
                  advantage=float(s.advantage), prox_logprobs=prox, reward=float(s.reward),
                  values=None if s.values is None else list(s.values),
                  ref_logprobs=None if s.ref_logprobs is None else list(s.ref_logprobs))


def plan_train(batch: list, spec: RunSpec, version: int, world: int) -> list[TrainRequest]:
    """One request per global rank for ``Trainer.train_step(batch)`` over the world."""
    from workers.train.trainer import minibatch_parts, needs_proximal, step_denominator

    algo, budget = spec.algorithm, spec.trainer.micro_batch_tokens
    lengths = [_length(s) for s in batch]
    single = algo.minibatches == 1 and algo.ppo_epochs == 1
    parts = ([list(range(len(batch)))] if single else
             minibatch_parts(len(batch), algo.minibatches, algo.ppo_epochs, spec.seed, version))
    shares = [split_by_tokens(part, lengths, world) for part in parts]
    micro = [max(1, *(_micro_batches(s, lengths, budget) for s in split)) for split in shares]
    denominators = [step_denominator([batch[i] for i in part], algo.normalize) for part in parts]
    # A rank's π_prox is that of the samples it trains on (with several epochs these overlap
    # between ranks: recomputed rather than exchanged).
    mine = [sorted({i for split in shares for i in split[r]}) for r in range(world)]
    most = max(1, *(_micro_batches(m, lengths, budget) for m in mine))
    need = needs_proximal(parts, len(batch))
    proximal = [[k for k, i in enumerate(m) if need[i]] for m in mine]
    prox_micro = 0 if single else max(1, *(_micro_batches([mine[r][k] for k in proximal[r]], lengths, budget)
                                           for r in range(world)))
    # gae: the critic's forwards, unless the critic stage valued every sample already
    critic_micro = most if algo.advantage == "gae" and any(s.values is None for s in batch) else 0
    owner: dict[int, int] = {}
    for r in range(world):
        for i in mine[r]:
            owner.setdefault(i, r)
    requests = []
    for r in range(world):
        pos = {i: k for k, i in enumerate(mine[r])}
        steps = [StepShare(samples=[pos[i] for i in split[r]], denominator=d, micro_batches=m)
                 for split, d, m in zip(shares, denominators, micro)]
        requests.append(TrainRequest(samples=[_sample(batch[i]) for i in mine[r]], steps=steps,
                                     proximal_micro_batches=prox_micro, proximal=[] if single else proximal[r],
                                     critic_micro_batches=critic_micro,
                                     counted=[k for k, i in enumerate(mine[r]) if owner[i] == r],
                                     grad_scale=float(world)))
    return requests


# -- the parent ------------------------------------------------------------------------------
class TrainerGroup:
    """``ranks`` trainer processes on this node (global ranks ``node_rank * ranks`` …), one
    DeepSpeed world of ``nnodes * ranks`` with the groups on the other nodes. Every node's
    group must get the same calls with the same batches (each trains its ranks' shares).

    A dead or failed rank makes the current and every later call raise ``TrainerRankError``
    (and stops the other ranks, which would wait in collectives forever)."""

    def __init__(self, spec: RunSpec, model_path: str, ranks: int, threads_per_rank: int | list[int] | None,
                 pad_id: int, *,
                 master_addr: str = "127.0.0.1", master_port: Optional[int] = None, nnodes: int = 1,
                 node_rank: int = 0, cuda_devices: Optional[list[str]] = None):
        if ranks < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
            raise ValueError(f"bad layout: ranks={ranks} nnodes={nnodes} node_rank={node_rank}")
        if cuda_devices is not None and len(cuda_devices) != ranks:
            raise ValueError(f"{len(cuda_devices)} cuda_devices for {ranks} ranks")
        if master_port is None:
            if nnodes > 1:
                raise ValueError("several nodes need an agreed master_port")
            master_port = free_port(master_addr)
        self.spec, self.model_path = spec, model_path
        self.ranks, self.world, self.first_rank = ranks, nnodes * ranks, node_rank * ranks
        self.version = 0
        self._lock = threading.Lock()  # one request/reply exchange at a time
        self._failure: Optional[TrainerRankError] = None
        self._closed = False
        self._stream = {"tokens": 0, "sequences": 0}
        self._procs: list = []
        self._conns: list[Connection] = []
        ctx = multiprocessing.get_context("spawn")
        try:
            for local in range(ranks):
                rank = self.first_rank + local
                env = {"RANK": str(rank), "WORLD_SIZE": str(self.world), "MASTER_ADDR": master_addr,
                       "MASTER_PORT": str(master_port), "LOCAL_RANK": str(local)}
                threads = threads_per_rank[local] if isinstance(threads_per_rank, list) else threads_per_rank
                if threads:
                    env["OMP_NUM_THREADS"] = str(threads)
                if cuda_devices is not None:
                    # As the plan says (workers/cluster/placement.py Plan.env) and DeepSpeed's launcher
                    # does: every rank of the node sees the node's trainer GPUs and takes
                    # cuda:LOCAL_RANK among them.
                    env.update(CUDA_VISIBLE_DEVICES=",".join(cuda_devices), LOCAL_RANK=str(local))
                config = _RankConfig(spec=spec, model_path=model_path, threads=threads, pad_id=pad_id,
                                     rank=rank, parent_pid=os.getpid(), env=env)
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(target=_rank_main, args=(config, child_end), name=f"fluxrl-trainer-rank{rank}",
                                   daemon=True)
                with _exec_environment(env):  # the rank's placement from exec on, as an engine server's
                    proc.start()
                child_end.close()  # so the parent sees EOF once the child is gone
                self._procs.append(proc)
                self._conns.append(parent_end)
            self._finalizer = weakref.finalize(self, _stop, list(self._procs), list(self._conns), 0.0)
            ready = self._gather()
            self.version = ready[0].version
            log.info("trainer group: ranks %d-%d of %d (pids %s), master %s:%d", self.first_rank,
                     self.first_rank + ranks - 1, self.world, [p.pid for p in self._procs], master_addr, master_port)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def __enter__(self) -> "TrainerGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the Trainer's interface -------------------------------------------------------
    def train_step(self, batch: list[TrainSample]) -> dict[str, float]:
        if not batch:
            raise ValueError("an empty batch")
        plan = plan_train(batch, self.spec, self.version, self.world)
        replies = self._call(plan[self.first_rank : self.first_rank + self.ranks])
        self.version = replies[0].version
        return dict(replies[0].stats)

    def begin_step(self) -> None:
        if self.world > 1 and self.spec.trainer.zero_stage >= 2:
            # ZeRO-2/3 reduce each streamed backward into their partitions as it runs; the
            # division of Trainer.finish_step(rescale=True) is tested against the whole-batch
            # step on one rank only (tests/workers/train/test_stream_precision.py): refused here
            # until it is tested over several.
            raise NotImplementedError("stream training over several ranks needs trainer.zero_stage 0 or 1")
        if self.world > 1 and self.spec.algorithm.advantage == "gae" and self.spec.critic.zero_stage >= 2:
            raise NotImplementedError("stream training over several ranks needs critic.zero_stage 0 or 1")
        self._stream = {"tokens": 0, "sequences": 0}
        self._call([BeginStepRequest()] * self.ranks)

    def accumulate(self, batch: list[TrainSample], denominator: float = 1.0, last: bool = False) -> None:
        budget = self.spec.trainer.micro_batch_tokens
        lengths = [_length(s) for s in batch]
        shares = split_by_tokens(list(range(len(batch))), lengths, self.world)
        micro = max(1, *(_micro_batches(s, lengths, budget) for s in shares))
        self._stream["tokens"] += sum(len(s.token_ids) for s in batch)
        self._stream["sequences"] += len(batch)
        mine = shares[self.first_rank : self.first_rank + self.ranks]
        self._call([AccumulateRequest(samples=[_sample(batch[i]) for i in share], denominator=denominator, last=last,
                                      micro_batches=micro, grad_scale=float(self.world)) for share in mine])

    def finish_step(self, sequences: int, rescale: bool = False) -> dict[str, float]:
        denominator = None
        if rescale:  # the whole step's, not each rank's own
            total = self._stream["tokens"] if self.spec.algorithm.normalize == "tokens" else sequences
            denominator = max(1.0, float(total))
        replies = self._call([FinishStepRequest(sequences=sequences, rescale=rescale, denominator=denominator)]
                             * self.ranks)
        self.version = replies[0].version
        return dict(replies[0].stats)

    def critic_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """The critic's full tensors, as ``state_dict`` gets the policy's."""
        return self.state_dict("critic")

    def state_dict(self, model: str = "policy") -> Optional[dict[str, torch.Tensor]]:
        """The full tensors (every rank takes part: a gather under ZeRO-3), from global rank 0:
        on node 0 only, None on the others."""
        from safetensors.torch import load as st_load

        from workers.weights.sync import tensors_checksum

        replies = self._call([StateDictRequest(model=model)] * self.ranks)
        if self.first_rank != 0:
            return None
        reply = replies[0]
        tensors = st_load(reply.blob)
        if tensors_checksum(tensors) != reply.checksum:
            raise TrainerRankError("the state dict from trainer rank 0 arrived corrupted (checksum mismatch)", 0)
        return tensors

    def write_weight_file(self, path: str) -> Optional["WeightFile"]:
        """The policy's full tensors as a safetensors file at ``path``, written by global rank
        0 itself (the coordinator's node: no copy of the model passes through a pipe); None
        on the other nodes."""
        from workers.weights.files import WeightFile

        self._call([StateDictRequest(model="policy", path=str(path))] * self.ranks)
        if self.first_rank != 0:
            return None
        return WeightFile(str(path), os.path.getsize(path))

    def save(self, path: str) -> None:
        """A complete HF folder, written by global rank 0 (on node 0)."""
        self._call([SaveRequest(path=str(path))] * self.ranks)

    def save_state(self, folder: str) -> None:
        """DeepSpeed's checkpoint: each rank writes its own ZeRO shard into ``folder``
        (on several nodes it must be storage they share)."""
        self._call([SaveStateRequest(folder=str(folder))] * self.ranks)

    def load_state(self, folder: str) -> int:
        replies = self._call([LoadStateRequest(folder=str(folder))] * self.ranks)
        self.version = replies[0].version
        return self.version

    # -- the weight group, hosted by global rank 0 (weight_broadcast.RankZeroSender) -----------
    def _rank0(self, request) -> "WeightGroupReply":
        if self.first_rank != 0:
            raise RuntimeError("global rank 0 is on node 0: only its group hosts the weight group")
        return self._call([request] * self.ranks)[0]

    def host_weight_group(self, host: str, world: int, backend: str, timeout_s: float) -> dict:
        """What the engines' join RPC carries (weight_broadcast.host_group): port, nccl_id."""
        reply = self._rank0(HostWeightGroupRequest(host=host, world=world, backend=backend, timeout_s=timeout_s))
        if reply.error is not None:
            raise RuntimeError(f"trainer rank 0 could not host the weight group: {reply.error}")
        return {"port": reply.port, **({"nccl_id": reply.nccl_id} if reply.nccl_id else {})}

    def form_weight_group(self) -> None:
        reply = self._rank0(FormWeightGroupRequest())
        if reply.error is not None:
            raise RuntimeError(f"trainer rank 0 could not form the weight group: {reply.error}")

    def prepare_weights(self, version: int, bucket_bytes: int) -> Optional[dict]:
        """Every rank gathers (ZeRO-3); rank 0 keeps the tensors and returns their metadata."""
        replies = self._call([PrepareWeightsRequest(version=version, bucket_bytes=bucket_bytes)] * self.ranks)
        return replies[0].meta if self.first_rank == 0 else None

    def send_weights(self) -> Optional[str]:
        """Rank 0 broadcasts what it prepared; the group's error, if it failed."""
        return self._rank0(SendWeightsRequest()).error

    def leave_weight_group(self) -> None:
        if self.first_rank == 0 and not self._closed and self._failure is None:
            self._rank0(LeaveWeightGroupRequest())

    # -- processes ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every rank (asking first when they are healthy); idempotent."""
        if self._closed:
            return
        self._closed = True
        grace = 0.0
        if self._failure is None:
            grace = _SHUTDOWN_GRACE_S
            for conn, proc in zip(self._conns, self._procs):
                if proc.is_alive():
                    try:
                        conn.send(ShutdownRequest().model_dump())
                    except OSError:
                        pass
        _stop(self._procs, self._conns, grace)
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer.detach()

    def _call(self, requests: list) -> list:
        with self._lock:
            self._check()
            for conn, request in zip(self._conns, requests):
                try:
                    conn.send(request.model_dump())
                except OSError:  # a dead rank: its sentinel says which and how, below
                    pass
            return self._gather()

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise TrainerRankError("the trainer group is closed")
        for local, proc in enumerate(self._procs):
            if not proc.is_alive():
                self._fail(local, None)

    def _gather(self) -> list:
        """One reply per local rank, or TrainerRankError as soon as one of them dies."""
        replies: list = [None] * self.ranks
        pending = {conn: local for local, conn in enumerate(self._conns)}
        sentinels = {proc.sentinel: local for local, proc in enumerate(self._procs)}
        while pending:
            if self._closed and self._failure is None:
                raise TrainerRankError("the trainer group was closed during a call")
            try:
                ready_list = wait(list(pending) + list(sentinels), timeout=_POLL_S)
            except (OSError, ValueError):  # close() from another thread closed the pipes
                if self._closed and self._failure is None:
                    raise TrainerRankError("the trainer group was closed during a call") from None
                raise
            for ready in ready_list:
                if ready in sentinels:
                    self._fail(sentinels[ready], None)
                local = pending.pop(ready)
                try:
                    reply = _REPLIES.validate_python(ready.recv())
                except (EOFError, OSError):
                    self._fail(local, None)
                if isinstance(reply, ErrorReply):
                    self._fail(local, f"{reply.error}\n{reply.traceback}")
                replies[local] = reply
        return replies

    def _fail(self, local: int, detail: Optional[str]) -> NoReturn:
        """Name the dead ranks (a killed one before those that then failed in a collective
        with it), stop the rest, raise."""
        if self._closed and self._failure is None:  # close() from another thread stopped the ranks
            raise TrainerRankError("the trainer group was closed during a call")
        details = {local: detail}
        deadline = time.monotonic() + 1.0  # peers of a dead rank fail within moments: report them together
        while time.monotonic() < deadline and all(p.is_alive() for i, p in enumerate(self._procs) if i != local):
            time.sleep(0.05)
        for i, (proc, conn) in enumerate(zip(self._procs, self._conns)):
            proc.join(timeout=0 if i != local else 5.0)
            if i not in details or details[i] is None:
                details[i] = _pending_error(conn)
        dead = [i for i, p in enumerate(self._procs) if p.exitcode is not None]
        # The cause: a rank that died without a word (killed), else the first to report an error.
        cause = next((i for i in dead if details.get(i) is None), local)
        parts = []
        for i in sorted(set(dead) | {local}, key=lambda i: (i != cause, i)):
            proc = self._procs[i]
            what = f"trainer rank {self.first_rank + i} (pid {proc.pid}) {_exit_text(proc.exitcode)}"
            parts.append(what + (f": {details[i]}" if details.get(i) else ""))
        self._failure = TrainerRankError("; ".join(parts), self.first_rank + cause, self._procs[cause].exitcode)
        log.error("%s", self._failure)
        self._closed = True
        _stop(self._procs, self._conns, 0.0)
        raise self._failure


def _exit_text(code: Optional[int]) -> str:
    if code is None:
        return "failed (still running)"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"was killed by signal {-code} (exit code {code})"
    return f"exited with code {code}"


def _pending_error(conn: Connection) -> Optional[str]:
    try:
        if conn.poll(0):
            reply = _REPLIES.validate_python(conn.recv())
            if isinstance(reply, ErrorReply):
                return reply.error
    except Exception:  # noqa: BLE001 — a half-written message from a dying rank
        pass
    return None


def _stop(procs: list, conns: list[Connection], grace: float) -> None:
    """Wait ``grace`` seconds for the ranks to exit, then SIGTERM, then SIGKILL; reap them."""
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 3.0
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)
    for conn in conns:
        conn.close()


# -- a rank ----------------------------------------------------------------------------------
_ENVIRON_LOCK = threading.Lock()


@contextlib.contextmanager
def _exec_environment(env: dict[str, str]):
    """``env`` over this process's environment while a spawned child is exec'd (spawn
    hands the child this process's environment; it has no per-child one), restored right
    after: the child then starts with its placement (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS
    before OpenMP sizes its pool at torch's import) and /proc/<pid>/environ shows it. One
    launch at a time holds the lock; the window is the fork and exec."""
    with _ENVIRON_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _rank_main(config: _RankConfig, conn: Connection) -> None:
    os.environ.update(config.env)  # before torch.distributed / DeepSpeed read it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops its ranks itself
    exit_with_parent(config.parent_pid)  # even while blocked in a collective
    code = 0
    try:
        rank = _Rank(config)
        conn.send(ReadyReply(rank=config.rank, pid=os.getpid(), version=rank.trainer.version).model_dump())
        while True:
            try:
                request = _REQUESTS.validate_python(conn.recv())
            except EOFError:  # the parent closed its end
                break
            if isinstance(request, ShutdownRequest):
                break
            conn.send(rank.handle(request).model_dump())
    except BaseException as exc:  # noqa: BLE001 — reported to the parent, then this rank exits
        log.exception("trainer rank %d failed", config.rank)
        code = 1
        try:
            conn.send(ErrorReply(rank=config.rank, error=f"{type(exc).__name__}: {exc}",
                                 traceback=traceback.format_exc(limit=8)).model_dump())
        except Exception:  # noqa: BLE001
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: process-group destructors can block on peers that are gone.
    os._exit(code)


class _Rank:
    def __init__(self, config: _RankConfig):
        from workers.train.trainer import Trainer

        self.rank = config.rank
        self.spec = config.spec
        self.trainer: Trainer = Trainer(config.spec, config.model_path, config.threads, config.pad_id)
        self.weights = _RankZeroWeights(self.trainer) if self.rank == 0 else None

    def handle(self, request) -> BaseModel:
        t = self.trainer
        if isinstance(request, TrainRequest):
            return self._train(request)
        if isinstance(request, (HostWeightGroupRequest, FormWeightGroupRequest, SendWeightsRequest,
                                LeaveWeightGroupRequest)):
            if self.weights is None:
                return DoneReply(rank=self.rank, version=t.version)
            return self.weights.handle(request)
        if isinstance(request, PrepareWeightsRequest):
            # a collective under ZeRO-3: every rank takes part, the sender (rank 0) keeps the copy
            state = t.state_dict(keep=self.weights is not None)
            if self.weights is None:
                return DoneReply(rank=self.rank, version=t.version)
            return self.weights.prepare(state, request)
        if isinstance(request, BeginStepRequest):
            t.begin_step()
        elif isinstance(request, AccumulateRequest):
            t.accumulate(self._samples(request.samples), request.denominator, request.last,
                         grad_scale=request.grad_scale, min_micro_batches=request.micro_batches)
        elif isinstance(request, FinishStepRequest):
            t.finish_step(request.sequences, request.rescale, denominator=request.denominator)
            return self._stats([t._acc], t._acc["seconds"], single=True, critic_sums=t.critic_sums)
        elif isinstance(request, StateDictRequest):
            return self._state(request.model, request.path)
        elif isinstance(request, SaveRequest):
            if self.rank == 0:
                t.save(request.path)
            elif self.spec.trainer.zero_stage == 3:
                t.state_dict(keep=False)  # rank 0's save gathers the shards: a collective
        elif isinstance(request, SaveStateRequest):
            t.save_state(request.folder)
        elif isinstance(request, LoadStateRequest):
            t.load_state(request.folder)
        else:
            raise TypeError(f"unexpected request {request.kind!r}")
        return DoneReply(rank=self.rank, version=t.version)

    @staticmethod
    def _samples(samples: list[Sample]) -> list[TrainSample]:
        from workers.train.trainer import TrainSample

        return [TrainSample(s.prompt_ids, s.token_ids, s.behav_logprobs, s.advantage, s.prox_logprobs,
                            reward=s.reward, values=s.values, ref_logprobs=s.ref_logprobs) for s in samples]

    def _train(self, request: TrainRequest) -> StatsReply:
        """``Trainer.train_step`` on this rank's shares of the planned steps."""
        t, t0 = self.trainer, time.perf_counter()
        algo = self.spec.algorithm
        single = algo.minibatches == 1 and algo.ppo_epochs == 1
        batch = self._samples(request.samples)
        sums = None
        if t.critic is not None:  # each rank's values for its samples; the statistics' sums added up below
            batch, sums = t.critic_targets(batch, min_micro_batches=request.critic_micro_batches,
                                           counted=request.counted)
        if not single:  # every rank runs the same number of forwards (ZeRO-3 gathers in each)
            prox = t.proximal_logprobs([batch[k] for k in request.proximal],
                                       min_micro_batches=request.proximal_micro_batches)
            for k, p in zip(request.proximal, prox):
                batch[k].prox_logprobs = p
        steps = []
        for step in request.steps:
            t.begin_step()
            t.accumulate([batch[i] for i in step.samples], denominator=step.denominator, last=True,
                         grad_scale=request.grad_scale, min_micro_batches=step.micro_batches)
            steps.append(dict(t._optimizer_step()))
        t.version += 1
        return self._stats(steps, time.perf_counter() - t0, single, sums)

    def _stats(self, steps: list[dict], seconds: float, single: bool,
               critic_sums: Optional[dict[str, float]] = None) -> StatsReply:
        """The step's statistics over all ranks, as ``Trainer`` reports them for one process:
        the losses are already shares of the whole step's (divided by its denominator), so
        they and the token counts add up; the time is the slowest rank's."""
        import torch
        import torch.distributed as dist

        from workers.train.algorithms import CRITIC_SUM_KEYS, critic_stats

        keys = ("loss", "kl", "clip", "entropy", "tokens", "padded", "micro", "dropped", "value_loss", "value_clip")
        device = self.trainer.engine.device
        sums = torch.tensor([[float(st[k]) for k in keys] for st in steps], dtype=torch.float64, device=device)
        slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
        critic = (torch.tensor([critic_sums[k] for k in CRITIC_SUM_KEYS], dtype=torch.float64, device=device)
                  if critic_sums is not None else None)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if critic is not None:
                dist.all_reduce(critic, op=dist.ReduceOp.SUM)
        rows = [dict(zip(keys, row)) for row in sums.tolist()]
        seconds = max(float(slowest.item()), 1e-9)
        tokens = max(sum(r["tokens"] for r in rows), 1)
        stats: dict[str, Union[int, float]] = {
            "loss/policy": sum(r["loss"] for r in rows) / len(rows),
            "loss/kl": sum(r["kl"] for r in rows) / len(rows),
            "policy/clip_frac": sum(r["clip"] for r in rows) / tokens,
            "policy/behav_dropped_frac": sum(r["dropped"] for r in rows) / tokens,
            "policy/entropy": sum(r["entropy"] for r in rows) / tokens,
            "trainer/tokens_per_s": sum(r["padded"] for r in rows) / seconds,
            "trainer/micro_batches": int(sum(r["micro"] for r in rows)),
        }
        if not single:
            stats["trainer/optimizer_steps"] = len(rows)
        if critic is not None:
            stats |= critic_stats(dict(zip(CRITIC_SUM_KEYS, critic.tolist())))
            stats["critic/value_loss"] = sum(r["value_loss"] for r in rows) / len(rows)
            stats["critic/value_clip_frac"] = sum(r["value_clip"] for r in rows) / tokens
        stats["trainer/step_s"] = seconds
        return StatsReply(rank=self.rank, version=self.trainer.version, stats=stats)

    def _state(self, model: str = "policy", path: Optional[str] = None) -> StateReply:
        t = self.trainer
        read = t.critic_state_dict if model == "critic" else t.state_dict
        stage = self.spec.critic.zero_stage if model == "critic" else self.spec.trainer.zero_stage
        if self.rank != 0:
            if stage == 3:
                read(keep=False)  # the gather is a collective: every rank takes part, rank 0 keeps the copy
            return StateReply(rank=self.rank)
        from workers.weights.files import write_weight_file
        from workers.weights.sync import serialize_state_dict, tensors_checksum

        state = read()
        if path is not None:  # no copy of the model in a message: the file is the coordinator's to send
            # the engines hash what they load (the resume check); model.lora: the adapter's config rides along
            write_weight_file(state, path, t.weight_metadata() if model == "policy" else None)
            return StateReply(rank=self.rank)
        return StateReply(rank=self.rank, blob=serialize_state_dict(state), checksum=tensors_checksum(state))


class _RankZeroWeights:
    """Global rank 0 as rank 0 of the weight group. A failure of the group is reported,
    not raised: the trainer is fine, the coordinator forms the group again."""

    def __init__(self, trainer: "Trainer"):
        self.trainer = trainer
        self.group = None
        self.forming: Optional[threading.Thread] = None
        self.formed: dict = {}
        self.meta: Optional[dict] = None
        self.sources: list = []

    def _reply(self, **fields) -> WeightGroupReply:
        return WeightGroupReply(rank=0, **fields)

    def handle(self, request) -> WeightGroupReply:
        from workers.weights.broadcast import host_group

        try:
            if isinstance(request, HostWeightGroupRequest):
                self.close()
                device = self.trainer.engine.device if request.backend == "nccl" else None
                join, form = host_group(request.host, request.world, request.backend, request.timeout_s, device)
                self.formed = {}

                def run() -> None:  # blocks until the engines joined; the rank answers meanwhile
                    try:
                        self.formed["group"] = form()
                    except BaseException as exc:  # noqa: BLE001
                        self.formed["error"] = f"{type(exc).__name__}: {exc}"

                self.forming = threading.Thread(target=run, name="weight-group-form", daemon=True)
                self.forming.start()
                return self._reply(port=join["port"], nccl_id=join.get("nccl_id"))
            if isinstance(request, FormWeightGroupRequest):
                if self.forming is not None:
                    self.forming.join()
                if "error" in self.formed or "group" not in self.formed:
                    return self._reply(error=self.formed.get("error", "the weight group was never hosted"))
                self.group = self.formed["group"]
                return self._reply()
            if isinstance(request, SendWeightsRequest):
                if self.group is None or self.meta is None:
                    return self._reply(error="no weight group, or nothing prepared to send")
                group, key = self.group, self.meta["abort_key"]
                try:
                    group.send(self.meta, self.sources, lambda: group.abort_requested(key))
                finally:
                    self.meta, self.sources = None, []
                return self._reply()
            if isinstance(request, LeaveWeightGroupRequest):
                self.close()
                return self._reply()
        except Exception as exc:  # noqa: BLE001 - the group's failure, reported
            log.warning("trainer rank 0: weight group: %s", exc)
            return self._reply(error=f"{type(exc).__name__}: {exc}")
        raise TypeError(f"unexpected request {request.kind!r}")

    def prepare(self, state: dict, request: PrepareWeightsRequest) -> WeightGroupReply:
        from workers.weights.broadcast import describe_state_dict

        self.meta, self.sources = describe_state_dict(state, request.version, request.bucket_bytes)
        return self._reply(meta=self.meta)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
