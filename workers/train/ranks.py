"""The trainer as N DeepSpeed ranks, each in its own process: data parallel at any
ZeRO stage (gloo on the CPU, NCCL on GPUs), a drop-in for ``Trainer`` in the controller.

``TrainerGroup`` starts this node's ranks (multiprocessing *spawn*; a rank's side:
rank_process.py) and talks to them over pipes with typed messages (rank_messages.py:
``TrainerRequest`` / ``TrainerReply``). Several groups with the same master address and
port, one per node, form one world.

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
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, NoReturn, Optional

from workers.io.ports import free_port
from workers.spec import PASSIVE_WAITS, RunSpec, shares_cores
from workers.train.rank_messages import (_REPLIES, AccumulateRequest, BeginStepRequest, ErrorReply, FinishStepRequest,
                                         FormWeightGroupRequest, HostWeightGroupRequest, LeaveWeightGroupRequest,
                                         LoadStateRequest, PrepareWeightsRequest, Sample, SaveRequest,
                                         SaveStateRequest, SendWeightsRequest, ShutdownRequest, StateDictRequest,
                                         StepShare, TrainRequest, WeightGroupReply, _RankConfig)
from workers.train.rank_process import _rank_main

if TYPE_CHECKING:  # torch and DeepSpeed load in a rank only after its environment is set
    import torch

    from workers.train.samples import TrainSample
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
                  ref_logprobs=None if s.ref_logprobs is None else list(s.ref_logprobs),
                  versions=None if getattr(s, "versions", None) is None else list(s.versions),
                  loss_mask=None if getattr(s, "loss_mask", None) is None else list(s.loss_mask),
                  token_rewards=None if getattr(s, "token_rewards", None) is None else list(s.token_rewards))


def plan_train(batch: list, spec: RunSpec, version: int, world: int) -> list[TrainRequest]:
    """One request per global rank for ``Trainer.train_step(batch)`` over the world."""
    from workers.train.samples import minibatch_parts, needs_proximal, step_denominator

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
                if cuda_devices is None and shares_cores(spec):
                    env |= PASSIVE_WAITS  # the engines compute on the same cores (resources.cpu_overlap)
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
        self._stream["tokens"] += sum(s.trained_tokens for s in batch)  # an episode's observations are not
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
