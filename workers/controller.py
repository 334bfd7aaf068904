"""Controller: turns a run spec into a trained policy by wiring the roles together.

- ``sync``: generate a whole batch → (scored as each sample finishes) → train → update.
- ``async``: rollouts and training overlap. Admission (``StalenessGate``) bounds how far
  ahead generation may run; finished samples stream to the reward service and into a
  queue; the trainer steps as soon as it has a batch, then pushes weights into running
  engines with the spec's update mode (keep = in-flight, interrupt, drain).

Everything here is asyncio in one process; the vLLM engines are their own processes
and the trainer's step runs in a thread so generation streams on meanwhile.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import pickle
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from collections import deque

from . import algorithms
from .checkpoint import CheckpointInfo, IncompleteCheckpoint, require_trainer_shards, save_checkpoint
from .preflight import check_run, resolve_model_path
from .length_ranker import LengthRanker
from .report import Reporter
from .reward_service import RewardService
from .rollout import Completion, RolloutEngine, SamplingOptions, configure_cpu_environment, continue_on
from .scheduling import plan_dispatch, plan_tail_migration
from .spec import RunSpec
from .staleness import StalenessGate
from .tasks import load_rows
from .trainer import TrainSample, Trainer
from .weight_broadcast import RankZeroSender, WeightBroadcaster, WeightBroadcastError
from .weight_sync import serialize_state_dict, tensors_checksum
from . import wire
from .engine_server import EngineClient, EngineServerConfig

logger = logging.getLogger(__name__)


@dataclass
class Sample:
    row: dict
    completion: Completion
    text: str
    reward: float
    error: Optional[str] = None
    parts: dict[str, float] = field(default_factory=dict)  # a summed reward's components, unweighted


@dataclass
class Group:
    samples: list[Sample]
    start_version: int
    index: int


@dataclass
class RunResult:
    steps: int = 0
    trained_samples: int = 0
    trained_tokens: int = 0
    seconds: float = 0.0
    accuracy_before: Optional[float] = None
    accuracy_after: Optional[float] = None
    sampled_reward_before: Optional[float] = None  # eval.samples > 0: expected held-out reward
    sampled_reward_after: Optional[float] = None
    staleness_max: int = 0
    dropped_stale: int = 0
    dropped_uniform: int = 0  # algorithm.drop_uniform_groups: groups whose rewards were all equal
    trained_groups: int = 0
    update_sync_ms: list[float] = field(default_factory=list)
    update_load_ms: list[float] = field(default_factory=list)
    gen_stall_ms: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    final_model: Optional[str] = None
    skipped_prompts: int = 0  # training + held-out prompts longer than max_model_len allows
    idle_generation: float = 0.0  # share of wall time no request was running (mean over engines)
    idle_training: float = 0.0  # share of wall time the trainer was not computing

    @property
    def samples_per_s(self) -> float:
        return self.trained_samples / self.seconds if self.seconds else 0.0


class TrainerError(RuntimeError):
    """The trainer raised: the run fails (exit code 1, status failed) with this as its reason."""


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(math.ceil(q * len(s))) - 1)]


def _plain_rng(state: tuple) -> list:
    """random.Random.getstate() as lists (torch.load(weights_only=True) reads them back)."""
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_tuple(state: list) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def _plain_numpy_rng(state: tuple) -> list:
    name, keys, pos, has_gauss, cached = state
    return [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]


def _numpy_rng_tuple(state: list) -> tuple:
    import numpy as np

    name, keys, pos, has_gauss, cached = state
    return (name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)


class Controller:
    def __init__(self, spec: RunSpec, out_dir: str | Path, reporter: Optional[Reporter] = None,
                 progress: bool = True, stop_event: Optional[asyncio.Event] = None,
                 resume: Optional[CheckpointInfo] = None, on_checkpoint=None, rendezvous: Optional[str] = None):
        self.spec = spec
        # several nodes: where the other nodes' agents join (workers/node.py)
        self.rendezvous = rendezvous or os.environ.get("FLUXRL_RENDEZVOUS")
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.reporter = reporter or Reporter(self.out / "metrics.jsonl")
        self.progress = progress
        self.stop = stop_event or asyncio.Event()
        self.engines: list[RolloutEngine] = []
        self.result = RunResult()
        self._failure: Optional[BaseException] = None
        self._rng = random.Random(spec.seed)
        self.ranker = LengthRanker()
        self.trainer_busy_s = 0.0
        self._load: dict[int, float] = {}  # engine index -> predicted tokens it is generating
        # Data position (saved in checkpoints): the current epoch's shuffled order, the next
        # index in it, and rows drawn before a checkpoint but not trained on (redone first).
        self._row_order: list[int] = []
        self._row_pos = 0
        self._redo: deque[dict] = deque()
        self.resume = resume  # a checkpoint to continue from (workers/checkpoint.py)
        self.on_checkpoint = on_checkpoint  # called (step, version, path) after each save
        self._checkpoint_and_stop = False  # request_checkpoint_and_stop (SIGTERM)
        self._first_step = 1
        self.migrations = 0  # sequences moved to another engine (rollout.migrate_tail)
        self._seconds_before = 0.0  # training time before the resumed checkpoint
        self._gen_busy_before = 0.0
        # Rollout engines whose core process dies are taken out of service; their requests
        # continue on a live engine. (Restarting one in the same process is not done: a
        # restart attempt hung, see issue #7.)
        self.engine_deaths = 0
        self.last_sampled_reward: Optional[float] = None  # of the latest evaluation (eval.samples)
        self._dead: list[RolloutEngine] = []
        self._retired_tokens, self._retired_busy = 0, 0.0  # counters of dead engines
        self.broadcaster: Optional[WeightBroadcaster] = None  # rollout.weight_transport: collective

    # -- set-up -------------------------------------------------------------------
    def _placement(self):
        """Where every process runs (workers/placement.py): this machine describes every node."""
        import torch

        from .placement import Machine, detect_machine, plan_cpu, plan_placement

        if torch.cuda.is_available():
            return plan_placement(self.spec, detect_machine())
        return plan_cpu(self.spec, Machine(cpu_cores=os.cpu_count() or 1))

    def _engine_config(self, process, checked, host: str = "127.0.0.1") -> EngineServerConfig:
        """An engine server's configuration, with its placement (devices, cores, memory share)."""
        spec, ro = self.spec, self.spec.rollout
        return EngineServerConfig(
            model_path=spec.model.path, index=process.index, update_mode=ro.update_mode,
            max_model_len=checked.max_model_len, max_num_seqs=ro.max_num_seqs, dtype=spec.model.dtype,
            seed=spec.seed + process.index, rpc_timeout_s=ro.rpc_timeout_s, top_p=ro.top_p, top_k=ro.top_k,
            stop=list(ro.stop), stop_token_ids=list(checked.stop_ids), kv_cache_gb=ro.kv_cache_gb,
            gpu_memory_utilization=process.gpu_memory_utilization, host=host, env=self.plan.env(process),
            cpu_single_process=ro.cpu_single_process)

    async def setup(self) -> None:
        spec = self.spec
        t = spec.task
        self.train_rows, self.eval_rows = load_rows(t.dataset, t.size, t.eval_size, t.seed, t.prompt_field, t.answer_field)
        self.eval_rows = self.eval_rows[: spec.eval.prompts]
        # The model's tokenizer, stop ids and limits, checked before any process starts.
        spec.model.path = await asyncio.to_thread(resolve_model_path, spec.model.path)
        checked = await asyncio.to_thread(check_run, spec, self.train_rows, self.eval_rows)
        self.prompts = checked.renderer
        self.train_rows, self.eval_rows = checked.train_rows, checked.eval_rows
        self.result.skipped_prompts = sum(checked.skipped.values())
        self.rewards = RewardService(spec.reward)
        self.plan = self._placement()
        on_cpu = self.plan.device == "cpu"
        # In one process (no engine processes) every engine and the trainer share node 0's cores.
        configure_cpu_environment(self.plan.cpu_bind("engine") if on_cpu else None, spec.rollout.kv_cache_gb)
        res = spec.resources
        separate = res.engine_processes or res.nodes > 1
        if res.nodes > 1:
            await self._join_nodes(checked)
        elif res.trainer_ranks > 1 or res.trainer_process:  # DeepSpeed ranks, each a process of its own
            from .trainer_ranks import TrainerGroup

            self.trainer = await asyncio.to_thread(TrainerGroup, spec, spec.model.path, res.trainer_ranks,
                                                   self._threads_per_rank(0), checked.pad_id,
                                                   cuda_devices=self._trainer_devices(0))
        else:
            self.trainer = await asyncio.to_thread(Trainer, spec, spec.model.path,
                                                   self.plan.threads("trainer") if on_cpu else None, checked.pad_id)
        if self.resume is not None:
            await asyncio.to_thread(self._restore, self.resume)
        ro = spec.rollout
        collective = ro.weight_transport == "collective"
        # the collective path needs the blob only for the resume check
        blob = serialize_state_dict(self.trainer.state_dict()) if not collective or self.resume is not None else None
        if separate:  # each engine a server process of its own (workers/engine_server.py)
            remote = getattr(self, "_remote_engines", {})
            self.engines = [EngineClient(self._engine_config(p, checked), *remote.get(p.index, (None, None)))
                            for p in self.plan.engines]
        else:
            sampling = SamplingOptions(ro.top_p, ro.top_k, tuple(ro.stop), tuple(checked.stop_ids))
            self.engines = [
                RolloutEngine(spec.model.path, index=i, update_mode=spec.rollout.update_mode, sampling=sampling,
                              max_model_len=checked.max_model_len, max_num_seqs=spec.rollout.max_num_seqs,
                              dtype=spec.model.dtype, seed=spec.seed + i, rpc_timeout_s=spec.rollout.rpc_timeout_s,
                              gpu_memory_utilization=p.gpu_memory_utilization,
                              cpu_single_process=ro.cpu_single_process)
                for i, p in enumerate(self.plan.engines)
            ]
        for engine in self.engines:  # one at a time: start-up is CPU-heavy
            # warm_blob is the first update: on resume, the checkpoint's weights and version
            await engine.start(warm_blob=None if collective else blob,
                               version=0 if collective else self.trainer.version)
            self._load[engine.index] = 0.0
        if collective:  # the first weights (and version label) come through the group
            host = wire.parse_address(self.rendezvous)[0] if res.nodes > 1 else "127.0.0.1"
            # With trainer rank processes, rank 0 itself sends: the weights never pass through here.
            sender = RankZeroSender(self.trainer, ro.rpc_timeout_s) if hasattr(self.trainer, "send_weights") else None
            self.broadcaster = WeightBroadcaster(host=host, timeout_s=ro.rpc_timeout_s, sender=sender)
            await self.broadcaster.open(self.engines)
            await self._send_weights(self.trainer.version)
        if self.resume is not None:
            await self._note_resume(blob)

    def _threads_per_rank(self, node: int) -> Optional[int]:
        ranks = self.plan.on_node(node, "trainer")
        return max(1, self.plan.threads("trainer", node) // len(ranks)) if self.plan.device == "cpu" else None

    def _trainer_devices(self, node: int) -> Optional[list[str]]:
        ranks = self.plan.on_node(node, "trainer")
        return [str(p.gpus[0]) for p in ranks] if self.plan.device == "gpu" else None

    async def _join_nodes(self, checked) -> None:
        """Several nodes: wait for every other node's agent at the rendezvous, give each its
        part (trainer ranks, engine servers), form the trainer world with them."""
        from .node import Cluster, ClusterTrainer, NodeAssignment, free_port
        from .trainer_ranks import TrainerGroup

        spec, nodes = self.spec, self.spec.resources.nodes
        if not self.rendezvous:
            raise ValueError(f"resources.nodes is {nodes}: a run over several nodes needs a rendezvous address "
                             "(python -m workers run SPEC --rendezvous HOST:PORT here, and python -m workers node "
                             "--rendezvous HOST:PORT --node-rank R on each other node)")
        cluster = await asyncio.to_thread(Cluster, self.rendezvous, nodes)
        loop = asyncio.get_running_loop()

        def node_failed(error: BaseException) -> None:  # from the cluster's watch thread
            def fail() -> None:
                self._failure = self._failure or TrainerError(f"the run lost a node: {error}")
                self.stop.set()
            loop.call_soon_threadsafe(fail)

        cluster.on_failure = node_failed
        try:
            master_addr = cluster.host if cluster.host not in ("0.0.0.0", "") else "127.0.0.1"
            master_port = free_port(master_addr)
            ranks = len(self.plan.on_node(0, "trainer"))
            for node in range(1, nodes):
                cluster.assign(node, NodeAssignment(
                    spec=spec, model_path=spec.model.path, pad_id=checked.pad_id, master_addr=master_addr,
                    master_port=master_port, ranks=ranks, threads_per_rank=self._threads_per_rank(node),
                    cuda_devices=self._trainer_devices(node), run_dir=str(self.out.resolve()),
                    engines=[self._engine_config(p, checked) for p in self.plan.on_node(node, "engine")]))
            local = asyncio.ensure_future(asyncio.to_thread(
                TrainerGroup, spec, spec.model.path, ranks, self._threads_per_rank(0), checked.pad_id,
                master_addr=master_addr, master_port=master_port, nnodes=nodes, node_rank=0,
                cuda_devices=self._trainer_devices(0)))
            try:
                ready = [await asyncio.to_thread(cluster.ready, node, 1800.0) for node in range(1, nodes)]
            except BaseException:
                local.add_done_callback(lambda t: t.cancelled() or t.exception() or t.result().close())
                raise
            self.trainer = ClusterTrainer(await local, cluster)
        except BaseException:
            cluster.close()
            raise
        self._remote_engines = {e.index: (e.address, e.pid) for r in ready for e in r.engines}
        self.node_trainer_pids = {r.node_rank: list(r.trainer_pids) for r in ready}
        logger.info("%d node(s) joined: engines %s", nodes, sorted(self._remote_engines))

    async def close(self) -> None:
        if self.broadcaster is not None:
            self.broadcaster.close()
        for engine in self.engines + self._dead:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - a dead engine may fail to
                pass
        if hasattr(self, "rewards"):
            self.rewards.close()
        if hasattr(getattr(self, "trainer", None), "close"):  # trainer rank processes
            self.trainer.close()

    # -- roles ---------------------------------------------------------------------
    def _plan(self, rows: list[dict]) -> list[tuple[dict, RolloutEngine, float]]:
        """Dispatch order and engine for prompt groups (``schedule.dispatch``): predicted-long
        groups first and spread by predicted token load (longest_first), or as they come."""
        policy, size = self.spec.schedule.dispatch, self.spec.algorithm.group_size
        if policy == "longest_first":
            predicted = [p * size for p in self.ranker.predict([r["prompt"] for r in rows])]
        else:
            predicted = [1.0] * len(rows)
        loads = [self._load[e.index] for e in self.engines]
        plan = plan_dispatch(policy, predicted, loads, seed=self._rng.randrange(2**31))
        return [(rows[i], self.engines[e], predicted[i]) for i, e in plan]

    async def _generate(self, engine: RolloutEngine, row: dict, temperature: float) -> Completion:
        comp = await engine.generate(self.prompts.ids(row), self.spec.rollout.max_tokens, temperature)
        return await self._finish_elsewhere(engine, comp, temperature)

    async def _finish_elsewhere(self, engine: RolloutEngine, comp: Completion, temperature: float) -> Completion:
        """A sequence ``engine`` left unfinished (handed off, or the engine died), finished
        from its prefix by another engine; any other sequence as it is."""
        while comp.finish_reason in ("handed_off", "engine_died"):
            # migrated, or its engine died: finish it from its prefix on the idlest other live engine
            source = engine if comp.finish_reason == "handed_off" else None
            if comp.finish_reason == "engine_died":
                dead = next((e for e in self.engines + self._dead if e.index == comp.engine and e.dead), None)
                if dead is not None:
                    self._retire(dead, "its requests continue on the other engine(s)")
            target = self._live_engine(exclude=comp.engine, fallback=source)
            comp = await continue_on(target, comp, self.spec.rollout.max_tokens, temperature)
        return comp

    # -- rollout engines that die -----------------------------------------------------
    def _live_engine(self, exclude: Optional[int] = None,
                           fallback: Optional[RolloutEngine] = None) -> RolloutEngine:
        """The idlest live engine other than ``exclude`` (else ``fallback``, else any live
        one); raises when every engine is dead."""
        live = [e for e in self.engines if not e.dead]
        others = [e for e in live if e.index != exclude]
        pool = others or ([fallback] if fallback is not None and not fallback.dead else live)
        if not pool:
            raise RuntimeError("every rollout engine died")
        return min(pool, key=lambda e: len(e.active))

    def _retire(self, engine: RolloutEngine, why: str) -> None:
        """Take a dead engine out of service (once)."""
        if engine not in self.engines:
            return
        self.engines.remove(engine)
        self.engine_deaths += 1
        self._retired_tokens += engine.generated_tokens
        self._retired_busy += engine.busy_seconds()
        print(f"warning: rollout engine {engine.index} died (EngineDeadError: its core process exited); {why}; "
              f"{len(self.engines)} engine(s) live", file=sys.stderr)
        self._dead.append(engine)  # shut down at close

    async def _update(self, engine: RolloutEngine, blob, version: int):
        """Push weights (a blob, or a collective's share) to one engine; None if it died
        (it is retired; the others go on)."""
        try:
            return await engine.update_weights(blob, version)
        except Exception:
            if not engine.dead:
                raise
            self._retire(engine, "weight updates skip it")
            return None

    async def _send_weights(self, version: int) -> list:
        """The trainer's weights to every live engine by ``rollout.weight_transport``; the
        timings of the engines that took them."""
        if self.broadcaster is None:
            blob = await asyncio.to_thread(serialize_state_dict, self.trainer.state_dict())
            results = await asyncio.gather(*(self._update(e, blob, version) for e in list(self.engines)))
            return [t for t in results if t is not None]
        remote = isinstance(self.broadcaster.sender, RankZeroSender)
        # in this process: the full weights (a collective of the ranks under ZeRO-3); with
        # rank 0 sending, it gathers them itself
        state = None if remote else await asyncio.to_thread(self.trainer.state_dict)
        while True:
            if self.broadcaster.engines != self.engines:
                # A member died (retired) and broke the group: form it again with the live
                # engines (those that got this version already reload the same weights).
                if not self.engines:
                    return []  # every engine died: the run fails where it next needs one
                logger.warning("weight group formed again with %d live engine(s)", len(self.engines))
                await self.broadcaster.open(self.engines)
            members = list(self.broadcaster.engines)
            try:
                results = await self.broadcaster.broadcast(state, version, update=self._update)
                return [t for t in results if t is not None]
            except WeightBroadcastError:
                if not any(e.dead for e in members):
                    raise

    async def _migrate_tail(self) -> None:
        """During a synchronous step's generation: when few requests remain, move some
        from the busiest engine to the idlest (``rollout.migrate_tail``)."""
        tail = self.spec.rollout.migrate_tail
        while True:
            plan = plan_tail_migration([len(e.active) for e in self.engines], tail)
            if plan is not None:
                src, dst, count = plan
                self.migrations += await self.engines[src].hand_off(count)
                await asyncio.sleep(0.1)  # let the moved requests land before looking again
            await asyncio.sleep(0.02)

    @contextlib.asynccontextmanager
    async def _tail_migration(self):
        """Around a synchronous step's generation: migrate its tail while it runs."""
        migrator = None
        if self.spec.rollout.migrate_tail and len(self.engines) > 1:
            migrator = asyncio.create_task(self._migrate_tail())
        try:
            yield
        finally:
            if migrator is not None:
                migrator.cancel()

    async def _score(self, row: dict, comp: Completion) -> Sample:
        text = self.prompts.decode(comp.token_ids)
        fields = {k: v for k, v in row.items() if k != "prompt"}
        score = await self.rewards.score(row["prompt"], text, fields)
        return Sample(row, comp, text, score.reward, score.error, score.parts)

    async def _sample(self, engine: RolloutEngine, row: dict, temperature: float) -> Sample:
        return await self._score(row, await self._generate(engine, row, temperature))

    async def _group(self, row: dict, index: int, start_version: int, engine: RolloutEngine,
                     predicted: float = 0.0, score: bool = True) -> Group:
        """One prompt's group. Scored sample by sample as each finishes (fused), or left
        for the caller to score after a barrier (``score=False``)."""
        self._load[engine.index] += predicted
        try:
            if self._one_request_per_group(engine):
                samples = await self._group_request(engine, row, self.spec.rollout.temperature, score)
            else:
                work = self._sample if score else self._generate
                samples = await asyncio.gather(*(work(engine, row, self.spec.rollout.temperature)
                                                 for _ in range(self.spec.algorithm.group_size)))
        finally:
            self._load[engine.index] -= predicted
        lengths = [(s.completion if score else s).length for s in samples]
        self.ranker.observe_group(row["prompt"], lengths)
        return Group(list(samples), start_version, index)

    def _one_request_per_group(self, engine: RolloutEngine) -> bool:
        """Whether a prompt group goes to its engine as one request of ``group_size``
        samples (vLLM parallel sampling: one request's overhead instead of one per sample).
        Not where each sample must be a request of its own: interrupt updates resubmit each
        sequence from its prefix, and the tail migrator (rollout.migrate_tail) hands off
        single requests. ``rollout.group_requests: false`` sends per-sample requests
        everywhere (to measure the difference)."""
        rollout = self.spec.rollout
        return (self.spec.algorithm.group_size > 1 and rollout.group_requests and engine.update_mode != "interrupt"
                and not rollout.migrate_tail)

    async def _group_request(self, engine: RolloutEngine, row: dict, temperature: float, score: bool) -> list:
        """A prompt group's samples from one engine request, in sample order: each sample is
        finished elsewhere if its engine died, and scored (``score``) as soon as it is done,
        as with a request per sample."""
        async def finish(comp: Completion):
            comp = await self._finish_elsewhere(engine, comp, temperature)
            return await self._score(row, comp) if score else comp

        finishing: dict[int, asyncio.Task] = {}
        try:
            async with contextlib.aclosing(engine.stream_group(self.prompts.ids(row), self.spec.algorithm.group_size,
                                                               self.spec.rollout.max_tokens, temperature)) as done:
                async for index, comp in done:
                    finishing[index] = asyncio.ensure_future(finish(comp))
            return list(await asyncio.gather(*(finishing[i] for i in sorted(finishing))))
        finally:
            for task in finishing.values():  # left running only by an error or a cancellation
                task.cancel()

    async def _in_trainer(self, fn, *args):
        """Run trainer work in a thread (generation streams on meanwhile), timing it."""
        t0 = time.perf_counter()
        try:
            return await asyncio.to_thread(fn, *args)
        except Exception as exc:  # not a bad-input exit (2) even if it is a ValueError
            raise TrainerError(f"the trainer failed: {type(exc).__name__}: {exc}") from exc
        finally:
            self.trainer_busy_s += time.perf_counter() - t0

    def _train_samples(self, group: Group) -> list[TrainSample]:
        """Group-relative advantages need only the group itself, so a group can be
        trained on the moment it is complete."""
        adv = algorithms.group_advantages([s.reward for s in group.samples], self.spec.algorithm.group_size,
                                          self.spec.algorithm.adv_std_norm)
        return [TrainSample(s.completion.prompt_ids, s.completion.token_ids, s.completion.logprobs, a)
                for s, a in zip(group.samples, adv)]

    def _rows(self):
        """Training rows, epoch after epoch in a shuffled order; rows a checkpoint saved
        as drawn but not trained on come first."""
        while True:
            if self._redo:
                yield self._redo.popleft()
                continue
            if self._row_pos >= len(self._row_order):
                self._row_order = list(range(len(self.train_rows)))
                self._rng.shuffle(self._row_order)
                self._row_pos = 0
            self._row_pos += 1
            yield self.train_rows[self._row_order[self._row_pos - 1]]

    # -- checkpoints ------------------------------------------------------------------
    def _checkpoint_due(self, step: int) -> bool:
        every = self.spec.trainer.checkpoint_every
        return bool(every) and step % every == 0

    def request_checkpoint_and_stop(self) -> None:
        """SIGTERM: finish the step in progress, save a checkpoint after it (whatever
        trainer.checkpoint_every says) and stop; a second request, or one before any step
        was trained here, stops at once."""
        if self._checkpoint_and_stop or self.result.steps < self._first_step:
            # asked twice, or nothing trained since the start (or the resumed checkpoint)
            self.stop.set()
        self._checkpoint_and_stop = True

    async def _checkpoint(self, step: int, t_start: float, unfinished: list[dict]) -> None:
        """Save a checkpoint after ``step`` if the spec asks for one now (workers/checkpoint.py),
        or a SIGTERM did; after the latter, stop. ``unfinished``: rows drawn but not trained
        on (in flight, scored but not batched); a resumed run generates them first, so no
        prompt is skipped."""
        on_request = self._checkpoint_and_stop
        if not (self._checkpoint_due(step) or on_request):
            return
        import torch

        # Everything captured now, in the loop's thread: generation goes on while the
        # files are written.
        state = self._controller_state(step, self.trainer.version, time.time() - t_start, unfinished)

        def write(folder: Path) -> None:
            self.trainer.save_state(str(folder / "trainer"))
            # Every rank's shard must be here before the checkpoint is published as complete.
            require_trainer_shards(folder / "trainer", *self._trainer_world())
            torch.save(state, folder / "state.pt")
            self.trainer.save(str(folder / "model"))

        meta = {"version": self.trainer.version, "weights_sha256": tensors_checksum(self.trainer.state_dict())}
        try:
            info = await asyncio.to_thread(save_checkpoint, self.out, step, write, meta)
        except IncompleteCheckpoint as exc:  # nothing published; training goes on without it
            logger.warning("checkpoint step-%d not saved: %s", step, exc)
            if on_request:
                self.stop.set()
            return
        if self.on_checkpoint is not None:
            try:
                await asyncio.to_thread(self.on_checkpoint, step, info.version, str(info.path))
            except Exception as exc:  # the checkpoint is on disk; the platform just does not know
                print(f"warning: could not report checkpoint step-{step}: {exc}", file=sys.stderr)
        if on_request:
            print(f"stopping after step {step}: checkpoint saved in {info.path}", file=sys.stderr)
            self.stop.set()

    def _controller_state(self, step: int, version: int, seconds: float, unfinished: list[dict]) -> dict:
        """The controller's part of a checkpoint (state.pt), as plain data (lists, dicts,
        numbers, strings, one tensor): torch.load(weights_only=True) reads it back."""
        import numpy as np
        import torch

        r = self.result
        return {
            "step": step, "version": version,
            "rows": {"order": list(self._row_order), "pos": self._row_pos,
                     "redo": list(unfinished) + list(self._redo)},
            "rng": {"controller": _plain_rng(self._rng.getstate()), "python": _plain_rng(random.getstate()),
                    "numpy": _plain_numpy_rng(np.random.get_state()), "torch": torch.get_rng_state()},
            "result": {"steps": r.steps, "trained_samples": r.trained_samples, "trained_tokens": r.trained_tokens,
                       "staleness_max": r.staleness_max, "dropped_stale": r.dropped_stale,
                       "dropped_uniform": r.dropped_uniform, "trained_groups": r.trained_groups,
                       "accuracy_before": r.accuracy_before},
            "seconds": seconds, "trainer_busy_s": self.trainer_busy_s,
            "gen_busy_s": self._gen_busy() - getattr(self, "_busy_before", 0.0),
            # plain data copied here, on the loop: the ranker object used to be pickled in
            # the writer thread while the loop went on learning ("deque mutated during iteration")
            "ranker": self.ranker.state_dict(),
        }

    def _trainer_world(self) -> tuple[int, int, bool]:
        """(data-parallel ranks, ZeRO stage, bf16): what names the trainer's checkpoint files."""
        spec = self.spec
        return getattr(self.trainer, "world", 1), spec.trainer.zero_stage, spec.model.dtype == "bfloat16"

    def _restore(self, info: CheckpointInfo) -> None:
        """Trainer (weights, optimiser, version) and controller state from a checkpoint."""
        import torch

        require_trainer_shards(info.path / "trainer", *self._trainer_world())  # refused, not half-loaded
        self.trainer.load_state(str(info.path / "trainer"))
        # Plain tensors, lists, dicts, numbers and strings only: nothing in a checkpoint
        # folder runs code when loaded.
        try:
            state = torch.load(info.path / "state.pt", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise RuntimeError(f"{info.path / 'state.pt'} holds pickled objects (a checkpoint of an older FluxRL) "
                               f"and is not loaded: start the run again without --resume ({exc})") from None
        self._load_controller_state(state)

    def _load_controller_state(self, state: dict) -> None:
        import numpy as np
        import torch

        self._row_order, self._row_pos = list(state["rows"]["order"]), state["rows"]["pos"]
        self._redo = deque(state["rows"]["redo"])
        self._rng.setstate(_rng_tuple(state["rng"]["controller"]))
        random.setstate(_rng_tuple(state["rng"]["python"]))
        np.random.set_state(_numpy_rng_tuple(state["rng"]["numpy"]))
        torch.set_rng_state(state["rng"]["torch"])
        for key, value in state["result"].items():
            setattr(self.result, key, value)
        self.ranker.load_state_dict(state["ranker"])
        self._first_step = state["step"] + 1
        self._seconds_before = state["seconds"]
        self.trainer_busy_s = state["trainer_busy_s"]
        self._gen_busy_before = state["gen_busy_s"]

    async def _note_resume(self, blob: bytes) -> None:
        """Say where the run resumes, and record that the engines hold the checkpoint's
        weights (checksums of what each engine loaded) in resume.json."""
        from safetensors.torch import load as st_load

        info = self.resume
        loaded = tensors_checksum(st_load(blob))
        engines = [await e.weights_checksum() for e in self.engines]
        record = {"from_step": info.step, "version": self.trainer.version, "checkpoint": str(info.path),
                  "checkpoint_sha256": info.meta.get("weights_sha256"), "trainer_sha256": loaded,
                  "engine_sha256": engines, "resumed_at": time.time()}
        (self.out / "resume.json").write_text(json.dumps(record, indent=2))
        same = loaded == info.meta.get("weights_sha256") and all(e == loaded for e in engines)
        print(f"resuming from {info.path} (step {info.step}, policy version {self.trainer.version}); "
              f"weights {'match the checkpoint' if same else 'DIFFER from the checkpoint'}", file=sys.stderr)
        if not same:
            raise RuntimeError(f"the weights loaded from {info.path} do not match its checksum")

    async def evaluate(self, step: int) -> float:
        """Greedy accuracy (mean reward) on the held-out rows; with ``eval.samples`` also the
        policy's expected held-out reward: the mean reward of that many completions per row
        sampled at the rollout temperature (what RL raises first, before the argmax moves)."""
        if not self.eval_rows:
            return float("nan")
        self._live_engine()  # fails clearly if every engine is dead
        engines = [e for e in self.engines if not e.dead]
        samples = await asyncio.gather(*(self._sample(engines[i % len(engines)], r, 0.0)
                                         for i, r in enumerate(self.eval_rows)))
        accuracy = sum(s.reward for s in samples) / len(samples)
        metrics = {"eval/accuracy": accuracy}
        k = self.spec.eval.samples
        if k:
            temperature = self.spec.rollout.temperature
            sampled = await asyncio.gather(*(self._sample(engines[i % len(engines)], r, temperature)
                                             for i, r in enumerate(self.eval_rows) for _ in range(k)))
            self.last_sampled_reward = sum(s.reward for s in sampled) / len(sampled)
            metrics["eval/sampled_reward"] = self.last_sampled_reward
        self.reporter.log(step, metrics)
        return accuracy

    # -- training step ----------------------------------------------------------------
    async def _train_on(self, groups: list[Group], step: int, t_start: float,
                        stats: Optional[dict] = None) -> None:
        """Train on a batch (unless a streamed step already did: ``stats``), push the new
        weights to every engine, and report the step."""
        spec = self.spec
        version = self.trainer.version - (1 if stats is not None else 0)
        rewards = [s.reward for g in groups for s in g.samples]
        samples = [s for g in groups for s in g.samples]
        staleness = [version - s.completion.versions.oldest for s in samples]
        if stats is None:
            batch = [t for g in groups for t in self._train_samples(g)]
            stats = await self._in_trainer(self.trainer.train_step, batch)
        timings = await self._send_weights(self.trainer.version)
        self.gate.advance(self.trainer.version)

        r = self.result
        lengths = [s.completion.length for s in samples]
        r.steps, r.trained_samples = step, r.trained_samples + len(samples)
        r.trained_groups += len(groups)
        r.trained_tokens += sum(lengths)
        r.lengths += lengths
        r.staleness_max = max(r.staleness_max, max(staleness))
        r.update_sync_ms += [t.sync_ms for t in timings]
        r.update_load_ms += [t.load_ms for t in timings]
        elapsed = time.time() - t_start
        mean_r = sum(rewards) / len(rewards)
        hist = {f"staleness/hist/{k}": staleness.count(k) for k in range(max(staleness) + 1)}
        self.reporter.log(step, {
            **{k: v for k, v in stats.items() if not k.startswith("trainer/micro") and k != "trainer/step_s"},
            "reward/mean": mean_r,
            "reward/std": statistics.pstdev(rewards),
            "reward/errors": sum(1 for s in samples if s.error),
            **({"batch/dropped_uniform_share": r.dropped_uniform / (r.dropped_uniform + r.trained_groups)}
               if spec.algorithm.drop_uniform_groups else {}),
            **{f"reward/part/{name}": sum(s.parts.get(name, 0.0) for s in samples) / len(samples)
               for name in samples[0].parts},
            "throughput/samples_per_s": r.trained_samples / elapsed,
            "throughput/tokens_per_s": r.trained_tokens / elapsed,
            "rollout/gen_tokens_per_s": (self._retired_tokens + sum(e.generated_tokens for e in self.engines)) / elapsed,
            "rollout/engines_live": len(self.engines),
            "rollout/engine_deaths": self.engine_deaths,
            "staleness/mean": sum(staleness) / len(staleness),
            "staleness/max": max(staleness),
            **hist,
            **({"weights/sync_ms": max(t.sync_ms for t in timings),
                "weights/load_ms": max(t.load_ms for t in timings)} if timings else {}),
            **self.ranker.metrics(),
            "idle/generation": self._idle_generation(elapsed),
            "idle/training": 1.0 - min(1.0, self.trainer_busy_s / elapsed),
            "lengths/mean": sum(lengths) / len(lengths),
            "lengths/p99": _percentile(lengths, 0.99),
            "queue/depth": self.ready.qsize() if hasattr(self, "ready") else 0,
            "version/current": self.trainer.version,
            "rollout/migrations": self.migrations,
        })
        # A few samples for the run page; a sequence spanning an update first.
        shown = sorted(samples, key=lambda s: (-len(s.completion.versions.runs), -s.completion.length))[:4]
        for s in shown:
            self.reporter.sample({"step": step, "prompt": self.prompts.text(s.row), "completion": s.text,
                                  "reward": s.reward, "versions": s.completion.versions.per_token(),
                                  "tokens": self.prompts.pieces(s.completion.token_ids),
                                  "length": s.completion.length, "error": s.error or ""})
        self._collect_stalls()
        if spec.eval.every_steps and step % spec.eval.every_steps == 0 and step < spec.stop.max_steps:
            await self.evaluate(step)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{mean_r:.2f}", stale=max(staleness), sps=f"{r.trained_samples / elapsed:.1f}")

    def _gen_busy(self) -> float:
        now = time.perf_counter()
        return self._retired_busy + sum(e.busy_seconds(now) for e in self.engines)

    def _idle_generation(self, elapsed: float) -> float:
        busy = self._gen_busy()
        return 1.0 - min(1.0, (busy - self._busy_before) / (elapsed * max(1, len(self.engines))))

    def _collect_stalls(self) -> None:
        for e in self.engines:
            done = [u for u in e.updates if u.gen_stall_ms is not None or u.version < self.trainer.version - 1]
            for u in done:
                if u.gen_stall_ms is not None:
                    self.result.gen_stall_ms.append(u.gen_stall_ms)
                    self.reporter.log(u.version, {"weights/gen_stall_ms": u.gen_stall_ms})
                e.updates.remove(u)

    def _out_of_time(self, t_start: float) -> bool:
        return self.stop.is_set() or (time.time() - t_start) / 60 > self.spec.stop.max_minutes

    # -- the two schedules ------------------------------------------------------------
    async def _run_sync(self, t_start: float) -> None:
        spec, rows = self.spec, self._rows()
        for step in range(self._first_step, spec.stop.max_steps + 1):
            if self._out_of_time(t_start):
                break
            self._live_engine()  # fails clearly if every engine is dead
            plan = self._plan([next(rows) for _ in range(spec.schedule.batch_prompts)])
            version = self.trainer.version
            if spec.schedule.stream_train:
                await self._sync_streamed_step(plan, step, t_start)
                await self._checkpoint(step, t_start, [])
                continue
            fused = spec.rollout.fused_scoring
            async with self._tail_migration():
                groups = await asyncio.gather(*(self._group(row, i, version, engine, pred, score=fused)
                                                for i, (row, engine, pred) in enumerate(plan)))
            if not fused:  # the barrier: score everything once generation is over
                for g in groups:
                    row = plan[g.index][0]
                    g.samples = list(await asyncio.gather(*(self._score(row, c) for c in g.samples)))
            await self._train_on(list(groups), step, t_start)
            await self._checkpoint(step, t_start, [])

    async def _sync_streamed_step(self, plan, step: int, t_start: float) -> None:
        """StreamRL's stream generation in a synchronous step: each group goes into the
        trainer's micro-batches as soon as it is scored, overlapping the generation tail."""
        version = self.trainer.version
        await self._in_trainer(self.trainer.begin_step)
        tasks = [asyncio.create_task(self._group(row, i, version, engine, pred))
                 for i, (row, engine, pred) in enumerate(plan)]
        groups = []
        async with self._tail_migration():
            for next_done in asyncio.as_completed(tasks):
                group = await next_done
                groups.append(group)
                await self._in_trainer(self.trainer.accumulate, self._train_samples(group))
        n = sum(len(g.samples) for g in groups)
        stats = await self._in_trainer(self.trainer.finish_step, n, True)
        await self._train_on(sorted(groups, key=lambda g: g.index), step, t_start, stats=stats)

    async def _run_async(self, t_start: float) -> None:
        spec, rows = self.spec, self._rows()
        self.ready: asyncio.Queue[Group] = asyncio.Queue()
        wake = asyncio.Event()
        pending: set[asyncio.Task] = set()
        counter = 0

        task_rows: dict[asyncio.Task, dict] = {}

        def finished(task: asyncio.Task) -> None:
            pending.discard(task)
            task_rows.pop(task, None)
            self.gate.finish(accepted=not task.cancelled() and task.exception() is None)
            if not task.cancelled() and task.exception() is not None:
                self._failure = self._failure or task.exception()
                self.stop.set()
            elif not task.cancelled():
                self.ready.put_nowait(task.result())
            wake.set()

        waiting: deque[dict] = deque()  # rows not yet started (a look-ahead window for dispatch)

        async def produce() -> None:
            nonlocal counter
            while not self.stop.is_set():
                free = self.gate.capacity - self.gate.finished - self.gate.running
                if free > 0:
                    while len(waiting) < free + spec.schedule.batch_prompts:
                        waiting.append(next(rows))
                    try:
                        self._live_engine()  # fails clearly if every engine is dead
                    except RuntimeError as exc:
                        self._failure = self._failure or exc
                        self.stop.set()
                        return
                    plan = self._plan(list(waiting))[:free]
                    for row, engine, predicted in plan:
                        waiting.remove(row)
                        version = self.gate.start()
                        task = asyncio.create_task(self._group(row, counter, version, engine, predicted))
                        counter += 1
                        pending.add(task)
                        task_rows[task] = row
                        task.add_done_callback(finished)
                wake.clear()
                await wake.wait()

        producer = asyncio.create_task(produce())
        stash: list[Group] = []
        try:
            for step in range(self._first_step, spec.stop.max_steps + 1):
                if self._out_of_time(t_start):
                    break
                batch: list[Group] = []
                while len(batch) < spec.schedule.batch_prompts and not self.stop.is_set():
                    stash.sort(key=lambda g: g.start_version)  # oldest first keeps staleness low
                    if stash:
                        group = stash.pop(0)
                    else:
                        get = asyncio.create_task(self.ready.get())
                        stopper = asyncio.create_task(self.stop.wait())
                        await asyncio.wait({get, stopper}, return_when=asyncio.FIRST_COMPLETED)
                        stopper.cancel()
                        if not get.done():
                            get.cancel()
                            break
                        group = get.result()
                        while not self.ready.empty():
                            stash.append(self.ready.get_nowait())
                        stash.append(group)
                        continue
                    if self.trainer.version - group.start_version > spec.schedule.max_staleness:
                        self.result.dropped_stale += 1  # would break the bound: never train on it
                        self.gate.release()
                        wake.set()
                        continue
                    if spec.algorithm.drop_uniform_groups and len({s.reward for s in group.samples}) == 1:
                        # DAPO's dynamic sampling: equal rewards give every sample a zero
                        # advantage, so the group would only thin the batch's signal; its
                        # slot goes back to the generator and another group takes its place.
                        self.result.dropped_uniform += 1
                        self.gate.release()
                        wake.set()
                        if self._out_of_time(t_start):
                            break
                        continue
                    batch.append(group)
                if len(batch) < spec.schedule.batch_prompts:
                    break
                await self._train_on(batch, step, t_start)
                wake.set()
                if self._checkpoint_due(step) or self._checkpoint_and_stop:  # rows drawn but not trained on go into it
                    stash.extend(self.ready.get_nowait() for _ in range(self.ready.qsize()))
                    unfinished = list(task_rows.values()) + [g.samples[0].row for g in stash] + list(waiting)
                    await self._checkpoint(step, t_start, unfinished)
        finally:
            self.stop.set()
            wake.set()
            producer.cancel()
            for task in list(pending):
                task.cancel()
            await asyncio.gather(producer, *pending, return_exceptions=True)

    async def run(self) -> RunResult:
        from tqdm import tqdm

        spec = self.spec
        try:
            await self.setup()
            if self.resume is None:  # a resumed run has it (and the step-0 points) already
                self.reporter.log(0, {"data/skipped_prompts": self.result.skipped_prompts})
                self.result.accuracy_before = await self.evaluate(0)
                self.result.sampled_reward_before = self.last_sampled_reward
            self.gate = StalenessGate(spec.schedule.batch_prompts,
                                      0 if spec.schedule.mode == "sync" else spec.schedule.max_staleness)
            # Resumed: the checkpoint's batches count as trained, so admission starts where it was.
            self.gate.advance(self.trainer.version)
            self.gate.finished = (self._first_step - 1) * spec.schedule.batch_prompts
            self.bar = tqdm(total=spec.stop.max_steps, initial=self._first_step - 1,
                            desc=f"{spec.name} [{spec.schedule.mode}]", unit="step", disable=not self.progress)
            # Resumed: times and totals continue from the checkpoint (throughput, idle
            # shares and stop.max_minutes count the training before it).
            t_start = time.time() - self._seconds_before
            # the evaluation above is not training time
            self._busy_before = sum(e.busy_s for e in self.engines) - self._gen_busy_before
            if self.resume is None:
                self.trainer_busy_s = 0.0
            if spec.schedule.mode == "sync":
                await self._run_sync(t_start)
            else:
                await self._run_async(t_start)
            self.result.seconds = time.time() - t_start
            self.result.idle_generation = self._idle_generation(self.result.seconds)
            self.result.idle_training = 1.0 - min(1.0, self.trainer_busy_s / max(self.result.seconds, 1e-9))
            self.bar.close()
            if self._failure is not None:
                raise self._failure
            self._collect_stalls()
            self.result.accuracy_after = await self.evaluate(self.result.steps)
            self.result.sampled_reward_after = self.last_sampled_reward
            final = self.out / "final_model"
            await asyncio.to_thread(self.trainer.save, str(final))
            self.result.final_model = str(final)
            return self.result
        finally:
            await self.close()
