"""The pipeline's rank processes (workers/train/pipeline.py), kept alive across steps.

``PipelineGroup`` starts ``stages`` processes (multiprocessing *spawn*), one per pipeline
stage; each holds its stage of the actor and of the critic (opposite directions: the
critic's first stage on the actor's last rank), an AdamW optimiser per model, and the
actor's learning-rate schedule. The parent sends every rank the same typed request over
its pipe and gathers the replies:

- ``TrainOp``: one step of both models' forwards and backwards in the given schedule, then
  (``step``) the tied embedding's gradients summed, each model's gradients clipped by its
  global norm over all ranks, and the optimiser steps;
- ``ValuesOp``: the critic's no-grad forward through its stages (the values GAE needs);
- ``StateOp`` / ``SaveOp`` / ``LoadOp``: weights and checkpoints;
- ``GradsOp``: the gradients of the last step, by the unsplit model's names (tests).

A rank that raises answers with its traceback; a rank that dies, or a reply that does not
come within the deadline, stops the whole group (``TrainerRankError``).
"""
from __future__ import annotations

import datetime
import json
import logging
import multiprocessing
import os
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Optional, Union

import torch

from workers.train import algorithms
from workers.train.pipeline import (MODELS, Hyper, bubble_share, build_stage, holds_tied_embedding, run_ops,
                                    schedule_for, stage_of)
from workers.train.ranks import TrainerRankError

log = logging.getLogger(__name__)

_POLL_S = 0.5


@dataclass(frozen=True)
class Optim:
    """Each model's optimiser: AdamW, the actor's lr on the trainer's schedule, the
    critic's constant (as workers/train/critic.py); gradients clipped by global norm."""
    lr: float = 1e-4
    critic_lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup: int = 0
    decay: str = "constant"
    total: int = 0
    floor: float = 0.0

    @classmethod
    def of(cls, spec) -> "Optim":
        algo = spec.algorithm
        return cls(lr=algo.lr, critic_lr=spec.critic.lr or algo.lr, weight_decay=algo.weight_decay,
                   grad_clip=algo.grad_clip, warmup=algo.warmup_steps, decay=algo.lr_decay,
                   total=spec.stop.max_steps * algo.minibatches * algo.ppo_epochs, floor=algo.lr_floor)


# -- messages (parent -> every rank) ---------------------------------------------------------
@dataclass(frozen=True)
class TrainOp:
    micro_batches: list  # dicts of tensors (pipeline.micro_batches)
    hyper: Any  # pipeline.Hyper
    schedule: str  # "fused" or "sequential"
    step: bool = True  # False: leave the gradients (benchmarks, tests)


@dataclass(frozen=True)
class ValuesOp:
    batches: list  # (ids, att) pairs


@dataclass(frozen=True)
class StateOp:
    model: str


@dataclass(frozen=True)
class GradsOp:
    pass


@dataclass(frozen=True)
class SaveOp:
    folder: str


@dataclass(frozen=True)
class LoadOp:
    folder: str


@dataclass(frozen=True)
class StopOp:
    pass


Request = Union[TrainOp, ValuesOp, StateOp, GradsOp, SaveOp, LoadOp, StopOp]


@dataclass(frozen=True)
class Reply:
    value: Any = None
    error: Optional[str] = None


@dataclass(frozen=True)
class RankStep:
    """One rank's part of a ``TrainOp``."""
    compute_s: float  # forwards and backwards
    wall_s: float  # the schedule's wall time on this rank (from a common start)
    stats: dict = field(default_factory=dict)  # per model: the loss sums of its last stage here
    grad_norm: dict = field(default_factory=dict)  # per model, before clipping (every rank the same)


# -- a rank ---------------------------------------------------------------------------------
def _rank_main(rank: int, stages: int, model_path: str, optim: Optim, head_seed: Optional[int], threads: int,
               timeout_s: float, parent_pid: int, conn: Connection) -> None:
    import torch.distributed as dist

    from workers.io.stores import interface_of, master_store
    from workers.io.lifetime import exit_with_parent

    exit_with_parent(parent_pid)  # the pid from the parent: it may be gone before this line
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if rank == 0:  # the rendezvous store on a loopback port of rank 0's; the parent passes it on
            store = master_store("127.0.0.1", 0, stages, timeout)
            conn.send(Reply(value=store.port))
        else:
            store = dist.TCPStore("127.0.0.1", conn.recv(), stages, is_master=False, timeout=timeout)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface_of("127.0.0.1") or "lo")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=stages, timeout=timeout)
        server = _RankServer(rank, stages, model_path, optim, head_seed)
        conn.send(Reply(value="ready"))
    except BaseException:
        conn.send(Reply(error=traceback.format_exc()))
        return
    while True:
        request = conn.recv()
        if isinstance(request, StopOp):
            conn.send(Reply(value="stopped"))
            dist.destroy_process_group()
            return
        try:
            conn.send(Reply(value=server.handle(request)))
        except BaseException:
            conn.send(Reply(error=traceback.format_exc()))


class _RankServer:
    def __init__(self, rank: int, stages: int, model_path: str, optim: Optim, head_seed: Optional[int]):
        import torch.distributed as dist


        self.rank, self.stages, self.optim = rank, stages, optim
        self.models = {m: build_stage(model_path, m, stage_of(m, rank, stages), stages, head_seed) for m in MODELS}
        self.hidden = self.models["actor"].base.config.hidden_size
        self.tied = holds_tied_embedding(self.models["actor"], rank, stages)
        # every rank creates the group; the actor's first and last stage use it
        self.ties = dist.new_group([0, stages - 1])
        self.optimizers = {
            m: torch.optim.AdamW(self.models[m].parameters(), lr=optim.lr if m == "actor" else optim.critic_lr,
                                 weight_decay=optim.weight_decay)
            for m in MODELS}
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizers["actor"], lambda s: algorithms.lr_factor(
            s, optim.warmup, optim.decay, optim.total, optim.floor))
        self._schedules: dict[tuple, list] = {}

    def handle(self, request: Request):
        if isinstance(request, TrainOp):
            return self._train(request)
        if isinstance(request, ValuesOp):
            return self._values(request.batches)
        if isinstance(request, StateOp):
            return self.models[request.model].owned_state()
        if isinstance(request, GradsOp):
            return {f"{m}/{module.full_name(name)}": p.grad.detach().clone()
                    for m, module in self.models.items() for name, p in module.named_parameters()
                    if p.grad is not None}
        if isinstance(request, SaveOp):
            torch.save({"models": {m: module.state_dict() for m, module in self.models.items()},
                        "optimizers": {m: opt.state_dict() for m, opt in self.optimizers.items()},
                        "scheduler": self.scheduler.state_dict()},
                       os.path.join(request.folder, f"pipeline-rank{self.rank}.pt"))
            return None
        if isinstance(request, LoadOp):
            state = torch.load(os.path.join(request.folder, f"pipeline-rank{self.rank}.pt"), weights_only=True)
            for m, module in self.models.items():
                module.load_state_dict(state["models"][m])
                self.optimizers[m].load_state_dict(state["optimizers"][m])
            self.scheduler.load_state_dict(state["scheduler"])
            return None
        raise TypeError(f"a pipeline rank got an unknown request {type(request).__name__}")

    def _ops(self, schedule: str, micro: int) -> list:
        key = (schedule, micro)
        if key not in self._schedules:
            self._schedules[key] = schedule_for(schedule, self.stages, micro)[self.rank]
        return self._schedules[key]

    def _train(self, op: TrainOp) -> RankStep:
        import torch.distributed as dist


        for module in self.models.values():
            module.zero_grad(set_to_none=True)
        stats: dict = {m: {} for m in MODELS}
        dist.barrier()  # every rank starts together: the wall time is the schedule's
        start = time.perf_counter()
        compute = run_ops(self._ops(op.schedule, len(op.micro_batches)), self.models, op.micro_batches, self.rank,
                          self.stages, self.hidden, op.hyper, stats)
        if self.tied:  # the LM head's share and the embedding's, summed on both copies
            dist.all_reduce(self.models["actor"].base.embed_tokens.weight.grad, group=self.ties)
        wall = time.perf_counter() - start
        norms = self._clip() if op.step else {}
        if op.step:
            for optimizer in self.optimizers.values():
                optimizer.step()
            self.scheduler.step()
        return RankStep(compute_s=compute, wall_s=wall, stats=stats, grad_norm=norms)

    def _clip(self) -> dict[str, float]:
        """Each model's gradients scaled to at most ``grad_clip`` in global norm over all
        its stages (as DeepSpeed's ``gradient_clipping``); returns the norms before."""
        import torch.distributed as dist

        squares = torch.zeros(len(MODELS), dtype=torch.float64)
        for i, m in enumerate(MODELS):
            module = self.models[m]
            for name, p in module.named_parameters():
                if p.grad is None:
                    continue
                if m == "actor" and self.tied and not module.first and name.startswith("base.embed_tokens."):
                    continue  # the tied matrix counts once, on the first stage
                squares[i] += p.grad.detach().double().pow(2).sum()
        dist.all_reduce(squares)
        norms = squares.sqrt()
        for i, m in enumerate(MODELS):
            scale = min(1.0, self.optim.grad_clip / (float(norms[i]) + 1e-6))
            if scale < 1.0:
                for p in self.models[m].parameters():
                    if p.grad is not None:
                        p.grad.mul_(scale)
        return {m: float(norms[i]) for i, m in enumerate(MODELS)}

    @torch.no_grad()
    def _values(self, batches: list) -> Optional[list]:
        """The critic forward through its stages (the first on the last rank), micro-batch by
        micro-batch; the rank of its last stage (rank 0) returns [rows, columns-1] values."""
        import torch.distributed as dist


        module = self.models["critic"]
        stage = stage_of("critic", self.rank, self.stages)
        out_values = []
        for ids, att in batches:
            x = None
            if stage > 0:
                x = torch.empty(ids.shape[0], ids.shape[1], self.hidden)
                dist.recv(x, src=stage_of("critic", stage - 1, self.stages))
            out = module(x, ids, att)
            if module.last:
                out_values.append(out[:, :-1].float())
            else:
                dist.send(out.contiguous(), dst=stage_of("critic", stage + 1, self.stages))
        return out_values if module.last else None


# -- the parent's side ------------------------------------------------------------------------
class PipelineGroup:
    def __init__(self, model_path: str, stages: int, optim: Optional[Optim] = None, threads: int = 1,
                 head_seed: Optional[int] = None, timeout_s: float = 600.0):
        self.stages, self.timeout_s = stages, timeout_s
        ctx = multiprocessing.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(stages)]
        self._conns = [parent for parent, _ in pipes]
        self._procs = [ctx.Process(target=_rank_main, name=f"fluxrl-pipeline-{r}",
                                   args=(r, stages, model_path, optim or Optim(), head_seed, max(1, threads),
                                         timeout_s, os.getpid(), pipes[r][1]), daemon=True)
                       for r in range(stages)]
        for proc in self._procs:
            proc.start()
        for _, child in pipes:
            child.close()
        try:
            port = self._gather([0])[0]
            for r in range(1, stages):
                self._conns[r].send(port)
            self._gather(range(stages))  # "ready": models built, the process group formed
        except BaseException:
            self.close()
            raise
        log.info("pipeline of %d stages ready (pids %s, gloo store on 127.0.0.1:%s, %d thread(s) a rank)",
                 stages, self.pids, port, max(1, threads))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def call(self, request: Request) -> list:
        """``request`` to every rank; their replies, by rank."""
        for conn in self._conns:
            conn.send(request)
        return self._gather(range(self.stages))

    def _gather(self, ranks) -> list:
        """The replies of ``ranks`` in any order (an error from one fails the call at once:
        its peers may be waiting for it in gloo), by rank."""
        pending, replies = set(ranks), {}
        deadline = time.monotonic() + self.timeout_s
        while pending:
            ready = wait([self._conns[r] for r in pending], timeout=_POLL_S)
            for conn in ready:
                rank = self._conns.index(conn)
                try:
                    reply: Reply = conn.recv()
                except (EOFError, OSError):  # its end of the pipe closed (reset) as it died
                    self._procs[rank].join(5.0)
                    self._fail(f"pipeline rank {rank} died (exit code {self._procs[rank].exitcode})", rank,
                               self._procs[rank].exitcode)
                if reply.error is not None:
                    self._failed(rank, reply.error)
                replies[rank] = reply.value
                pending.discard(rank)
            if not ready:
                for rank, process in enumerate(self._procs):  # a dead peer leaves the others waiting in gloo
                    if not process.is_alive():
                        self._fail(f"pipeline rank {rank} died (exit code {process.exitcode})", rank,
                                   process.exitcode)
                if time.monotonic() > deadline:
                    self._fail(f"pipeline ranks {sorted(pending)} did not answer within {self.timeout_s:.0f} s",
                               min(pending), None)
        return [replies[r] for r in sorted(replies)]

    def _failed(self, rank: int, error: str):
        """A rank raised. A peer that died makes its gloo call fail: the dead one is named first."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for other, process in enumerate(self._procs):
                if other != rank and not process.is_alive():
                    last = error.strip().splitlines()[-1]
                    self._fail(f"pipeline rank {other} died (exit code {process.exitcode}); rank {rank}: {last}",
                               other, process.exitcode)
            time.sleep(0.05)
        self._fail(f"pipeline rank {rank} failed:\n{error}", rank, None)

    def _fail(self, message: str, rank: int, exitcode: Optional[int]):
        self.close(graceful=False)
        raise TrainerRankError(message, rank=rank, exitcode=exitcode)

    def close(self, graceful: bool = True) -> None:
        if graceful and all(p.is_alive() for p in self._procs):
            try:
                for conn in self._conns:
                    conn.send(StopOp())
                for conn in self._conns:
                    if conn.poll(10.0):
                        conn.recv()
            except (OSError, EOFError):
                pass
        for proc in self._procs:
            proc.join(timeout=5.0 if graceful else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> "PipelineGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests -------------------------------------------------------------------------
    def train(self, micro_batches: list[dict], hyper, schedule: str, step: bool = True) -> list[RankStep]:
        return self.call(TrainOp(micro_batches, hyper, schedule, step))

    def values(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        return self.call(ValuesOp(batches))[0]  # rank 0 holds the critic's last stage

    def state_dict(self, model: str) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for part in self.call(StateOp(model)):
            out.update(part)
        return out

    def grads(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for part in self.call(GradsOp()):
            for name, grad in part.items():  # a tied embedding is on two ranks, its gradient summed on both
                out.setdefault(name, grad)
        return out

    def save_state(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        self.call(SaveOp(folder))
        with open(os.path.join(folder, "pipeline.json"), "w", encoding="utf-8") as fh:
            json.dump({"stages": self.stages}, fh)

    def load_state(self, folder: str) -> None:
        meta_path = os.path.join(folder, "pipeline.json")
        if not os.path.exists(meta_path):
            raise FileNotFoundError(f"no pipeline checkpoint in {folder}")
        with open(meta_path, encoding="utf-8") as fh:
            saved = json.load(fh)["stages"]
        if saved != self.stages:
            raise ValueError(f"the checkpoint in {folder} has {saved} pipeline stages, this run {self.stages}: "
                             "resume with trainer.pipeline.stages as saved")
        self.call(LoadOp(folder))


# -- one measured step (bench/fused_pipeline.py, tests) -------------------------------------
@dataclass
class StepReport:
    schedule: str
    wall_s: float  # the slowest rank's
    compute_s: list[float]  # per rank
    bubble: float  # the ranks' mean idle share of the step (waiting for another rank)
    grads: Optional[list[dict]] = None  # per rank, by the unsplit models' names ("actor/model.norm.weight")


def run_step(model_path: str, micro_batches: list[dict], kind: str, stages: int = 2, hyper: Optional[Hyper] = None,
             threads: int = 1, steps: int = 1, grads: bool = False, timeout_s: float = 300.0) -> StepReport:
    """A training step of both models (forwards and backwards, no optimiser step; ``steps``
    of them, the same batch each time, for steadier timings) on ``stages`` rank processes
    (gloo on loopback) with the ``kind`` schedule. Reports the median step and (``grads``)
    each rank's gradients after the last, by the unsplit models' names."""
    hyper = hyper or Hyper(denominator=float(sum(mb["mask"].sum() for mb in micro_batches)))
    with PipelineGroup(model_path, stages, threads=threads, head_seed=hyper.head_seed, timeout_s=timeout_s) as group:
        results = [group.train(micro_batches, hyper, kind, step=False) for _ in range(steps)]
        rank_grads = group.call(GradsOp()) if grads else None
    walls = [max(r.wall_s for r in ranks) for ranks in results]
    middle = sorted(range(steps), key=lambda i: walls[i])[(steps - 1) // 2]  # the median step
    wall, compute = walls[middle], [r.compute_s for r in results[middle]]
    return StepReport(kind, wall, compute, bubble_share(wall, compute), rank_grads)
