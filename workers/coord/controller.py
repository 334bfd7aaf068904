"""Controller: turns a run spec into a trained policy by wiring the roles together.

- ``sync`` (sync_schedule.py): generate a whole batch → (scored as each sample finishes)
  → train → update.
- ``async`` (async_schedule.py): rollouts and training overlap. Admission
  (``StalenessGate``) bounds how far ahead generation may run; finished samples stream to
  the reward service and into a queue; the trainer steps as soon as it has a batch, then
  pushes weights into running engines with the spec's update mode (keep = in-flight,
  interrupt, drain).

The Controller owns the parts and the order they run in: the processes (processes.py),
the rollout fleet (generation.py), the checkpoints (checkpointing.py) and the step
metrics (step_metrics.py); it keeps the data position, the training step both schedules
share, and the evaluation.

Everything here is asyncio in one process; the vLLM engines are their own processes
and the trainer's step runs in a thread so generation streams on meanwhile.
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Optional

from workers.agents.episode import engine_ids, loss_mask, oldest_trained_version
from workers.coord.async_schedule import AsyncSchedule
from workers.coord.checkpointing import Checkpointer
from workers.coord.evaluation import EvalSets
from workers.coord.generation import EVALUATING, Fleet, Group, Sample
from workers.coord.length_ranker import LengthRanker
from workers.coord.processes import Processes, placement
from workers.coord.step_metrics import RunResult, StepMetrics, peak_resident_gib
from workers.coord.sync_schedule import SyncSchedule
from workers.coord.time_breakdown import TimeBreakdown
from workers.io.checkpoint import CheckpointInfo
from workers.io.report import Reporter
from workers.models.preflight import check_run, resolve_model_path
from workers.models.reward_model import resolve_reward_model_path
from workers.rollout.engine import RolloutEngine
from workers.rollout.engine_types import Completion
from workers.rollout.staleness import StalenessGate
from workers.spec import RunSpec
from workers.tasks.datasets import load_rows
from workers.train import algorithms
from workers.train.batching import token_exact
from workers.train.samples import TrainSample
from workers.weights.files import trainer_weight_file
from workers.weights.update import FileWeights

__all__ = ["Controller", "Group", "RunResult", "Sample", "TrainerError"]

logger = logging.getLogger(__name__)


class TrainerError(RuntimeError):
    """The trainer raised: the run fails (exit code 1, status failed) with this as its reason."""


def _part(part: str, name: str) -> property:
    """An attribute of one of the Controller's parts, read and set as the Controller's own."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value))


class Controller:
    # the parts' state, under the names it had on the Controller
    engines = _part("fleet", "engines")
    _dead = _part("fleet", "dead")
    engine_deaths = _part("fleet", "engine_deaths")
    migrations = _part("fleet", "migrations")
    broadcaster = _part("fleet", "broadcaster")
    prompts = _part("fleet", "prompts")
    rewards = _part("fleet", "rewards")
    trainer = _part("processes", "trainer")
    plan = _part("processes", "plan")
    node_trainer_pids = _part("processes", "node_trainer_pids")
    _first_step = _part("checkpoints", "first_step")
    _seconds_before = _part("checkpoints", "seconds_before")

    def __init__(self, spec: RunSpec, out_dir: str | Path, reporter: Optional[Reporter] = None,
                 progress: bool = True, stop_event: Optional[asyncio.Event] = None,
                 resume: Optional[CheckpointInfo] = None, on_checkpoint=None, rendezvous: Optional[str] = None):
        self.spec = spec
        # several nodes: where the other nodes' agents join (workers/cluster/node.py)
        self.rendezvous = rendezvous or os.environ.get("FLUXRL_RENDEZVOUS")
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.reporter = reporter or Reporter(self.out / "metrics.jsonl")
        self.progress = progress
        self.stop = stop_event or asyncio.Event()
        self.result = RunResult()
        self._failure: Optional[BaseException] = None
        self._rng = random.Random(spec.seed)
        self.ranker = LengthRanker()
        self.trainer_busy_s = 0.0
        # Data position (saved in checkpoints): the current epoch's shuffled order, the next
        # index in it, and rows drawn before a checkpoint but not trained on (redone first).
        self._row_order: list[int] = []
        self._row_pos = 0
        self._redo: deque[dict] = deque()
        self.resume = resume  # a checkpoint to continue from (workers/io/checkpoint.py)
        self.on_checkpoint = on_checkpoint  # called (step, version, path) after each save
        self.last_sampled_reward: Optional[float] = None  # of the latest evaluation (eval.samples)
        self.eval_sets = EvalSets(spec)  # eval.sets: pass@k and avg@n per held-out set (evaluation.py)
        self.bar = None  # the progress bar, while the schedule runs
        self.schedule: Optional[SyncSchedule | AsyncSchedule] = None
        self.processes = Processes(spec, self.out, self.rendezvous, self._lost_node)
        # _generate and _score through the Controller: a subclass that overrides them sees every sample
        self.fleet = Fleet(spec, self.ranker, self._rng, generate=self._generate, score=self._score)
        self.checkpoints = Checkpointer(self)
        self.metrics = StepMetrics(self)
        self.times = TimeBreakdown()  # each step's time/<part>_s (time_breakdown.py)

    # -- set-up -------------------------------------------------------------------
    def _placement(self):
        return placement(self.spec)

    async def setup(self) -> None:
        spec = self.spec
        t = spec.task
        self.train_rows, held_out = load_rows(t.dataset, t.size, t.eval_size, t.seed, t.prompt_field, t.answer_field)
        self.eval_rows = held_out[: spec.eval.prompts]
        set_rows = self.eval_sets.load(held_out)  # copies: told apart from eval_rows by identity below
        # The model's tokenizer, stop ids and limits, checked before any process starts.
        spec.model.path = await asyncio.to_thread(resolve_model_path, spec.model.path)
        if spec.reward.model is not None:
            spec.reward.model.path = await asyncio.to_thread(resolve_reward_model_path, spec.reward.model.path)
        # the sets' prompts are checked with the run's: max_model_len must hold them too
        checked = await asyncio.to_thread(check_run, spec, self.train_rows, self.eval_rows + set_rows)
        self.prompts = checked.renderer
        own = {id(r) for r in self.eval_rows}
        self.train_rows, self.eval_rows = checked.train_rows, [r for r in checked.eval_rows if id(r) in own]
        self.eval_sets.keep(checked.eval_rows)
        self.result.skipped_prompts = sum(checked.skipped.values())
        if t.environment is not None and self.train_rows and self.prompts.is_chat(self.train_rows[0]):
            # the observations' chat deltas: a template that is not prefix-stable fails here, before any process
            await asyncio.to_thread(self.fleet.observations().prepare)
        self.processes.start(self._placement)
        self.rewards = self.processes.rewards
        self.eval_sets.start_rewards()
        collective = spec.rollout.weight_transport == "collective"
        beside = self.processes.starts_beside_trainer()
        starting = None
        if beside:  # the engines start while the trainer loads; the trainer's weights follow as an update
            self.fleet.add(self.processes.engines(checked))  # in the fleet before they start: close() stops them
            starting = asyncio.ensure_future(self.processes.start_engines(self.engines, None, 0, together=True))
        try:
            await self.processes.start_trainer(checked)
            self.fleet.reference = self.processes.reference  # None unless algorithm.kl_reference is 'stage'
            self.fleet.critic = self.processes.critic_stage  # None unless critic.forward is 'stage'
            if self.resume is not None:
                await asyncio.to_thread(self._restore, self.resume)
            await self._load_critic_stage()  # before the first sample is valued, resumed or not
        except BaseException:
            if starting is not None:  # close() then stops what did start
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
            raise
        # the collective path needs the file only for the resume check
        rpc_warm = not collective and not beside  # the RPC path's first weights ride on the engines' start
        with tempfile.TemporaryDirectory(prefix="fluxrl-weights-") as folder:
            warm = (await asyncio.to_thread(trainer_weight_file, self.trainer, folder, self.trainer.version)
                    if rpc_warm or self.resume is not None else None)
            if beside:
                await starting
                if not collective:  # the first weights (and version label), as the collective path sends them
                    await self._send_weights(self.trainer.version)
            else:
                self.fleet.add(self.processes.engines(checked))  # in the fleet before they start: close() stops them
                # the warm weights are the first update: on resume, the checkpoint's weights and version
                await self.processes.start_engines(self.engines, None if collective else FileWeights.of(warm),
                                                   0 if collective else self.trainer.version)
            if collective:  # the first weights (and version label) come through the group
                self.broadcaster = await self.processes.open_weight_group(self.engines)
                self.broadcaster.digest_next = self.resume is not None  # checked by note_resume
                await self._send_weights(self.trainer.version)
            if self.resume is not None:
                await self.checkpoints.note_resume(warm)

    async def _load_critic_stage(self) -> Optional[float]:
        """critic.forward stage: the trainer critic's weights into the stage's copy; the seconds it took."""
        stage = self.processes.critic_stage
        if stage is None:
            return None
        t0 = time.perf_counter()
        state = await self._in_trainer(self.trainer.critic_state_dict)
        await asyncio.to_thread(stage.load, state, self.trainer.version)
        return time.perf_counter() - t0

    def _lost_node(self, error: BaseException) -> None:
        """A node of a run over several nodes is gone (called in the loop): the run fails."""
        self._fail(TrainerError(f"the run lost a node: {error}"))

    def _fail(self, error: BaseException) -> None:
        """The run fails with ``error`` (the first one wins): the schedule stops, run() raises it."""
        self._failure = self._failure or error
        self.stop.set()

    def _memory_peaks(self) -> dict[str, float]:
        """Each process of the run on this node, by role, and its peak resident memory so far."""
        pids = {"coordinator": os.getpid()}
        for rank, pid in enumerate(getattr(self.trainer, "pids", None) or []):
            pids[f"trainer rank {rank}"] = pid
        for engine in self.engines:
            if getattr(engine, "server_pid", None):
                pids[f"engine {engine.index} server"] = engine.server_pid
            for k, pid in enumerate(engine.core_pids()):
                pids[f"engine {engine.index} vLLM core" + (f" {k}" if k else "")] = pid
        # the inference stage's workers (named as the plan names them)
        rewards, procs = self.processes.rewards, self.processes
        for name, worker in (("reward model", rewards.model if rewards else None),
                             ("KL reference stage", procs.reference), ("critic stage", procs.critic_stage)):
            proc = getattr(worker, "proc", None)
            if proc is not None and proc.poll() is None:
                pids[name] = proc.pid
        peaks = {name: peak_resident_gib(pid) for name, pid in pids.items()}
        return {name: round(gib, 2) for name, gib in peaks.items() if gib is not None}

    async def close(self) -> None:
        self.processes.close(self.engines + self._dead, self.broadcaster)
        self.eval_sets.close()

    # -- the fleet's seams (a subclass may override these) ---------------------------------
    async def _generate(self, engine: RolloutEngine, row: dict, temperature: float) -> Completion:
        return await self.fleet.generate(engine, row, temperature)

    async def _score(self, row: dict, comp: Completion) -> Sample:
        with self.times.track("scoring"):
            return await self.fleet.score(row, comp)

    async def _send_weights(self, version: int) -> list:
        with self.times.track("weight_update"):
            return await self.fleet.send_weights(self.trainer, version)

    def _one_request_per_group(self, engine: RolloutEngine) -> bool:
        return self.fleet.one_request_per_group(engine)

    # -- data and trainer ------------------------------------------------------------------
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

    async def _in_trainer(self, fn, *args):
        """Run trainer work in a thread (generation streams on meanwhile), timing it."""
        t0 = time.perf_counter()
        self.times.begin("train")
        try:
            return await asyncio.to_thread(fn, *args)
        except Exception as exc:  # not a bad-input exit (2) even if it is a ValueError
            raise TrainerError(f"the trainer failed: {type(exc).__name__}: {exc}") from exc
        finally:
            self.times.end("train")
            self.trainer_busy_s += time.perf_counter() - t0

    def _train_samples(self, group: Group) -> list[TrainSample]:
        """Group-relative advantages need only the group itself, so a group can be
        trained on the moment it is complete. With GAE the trainer's critic computes them
        from each sample's reward."""
        rewards = [s.reward for s in group.samples]
        if self.spec.algorithm.advantage == "gae":
            adv = [0.0] * len(rewards)
        else:
            adv = algorithms.group_advantages(rewards, self.spec.algorithm.group_size,
                                              self.spec.algorithm.adv_std_norm)
        return [TrainSample(s.completion.prompt_ids, s.completion.token_ids, s.completion.logprobs, a, reward=r,
                            ref_logprobs=s.ref_logprobs, values=s.values, versions=s.completion.versions.per_token(),
                            loss_mask=loss_mask(s.completion), token_rewards=s.token_rewards)
                for s, a, r in zip(group.samples, adv, rewards)]

    def _token_exactness(self, groups: list[Group]) -> dict[str, float]:
        """task.environment: agent/token_exact, the share of the step's samples whose ids at
        the trained positions, packed as the trainer packs them (batching.py), equal the ids
        the engine returned turn by turn. Anything below 1.0 is a bug, logged loudly."""
        if self.spec.task.environment is None:
            return {}
        samples = [s for g in groups for s in g.samples]
        exact = token_exact([(s.completion.prompt_ids, s.completion.token_ids) for s in samples],
                            [loss_mask(s.completion) for s in samples], [engine_ids(s.completion) for s in samples],
                            getattr(self.trainer, "pad_id", 0))
        if not all(exact):
            logger.error("token-exactness: %d of %d trained samples' ids differ from the engine's",
                         exact.count(False), len(exact))
        return {"agent/token_exact": sum(exact) / max(1, len(exact))}

    # -- checkpoints (checkpointing.py) ----------------------------------------------------
    def request_checkpoint_and_stop(self) -> None:
        """SIGTERM: finish the step in progress, save a checkpoint after it (whatever
        trainer.checkpoint_every says) and stop; a second request, or one before any step
        was trained here, stops at once."""
        self.checkpoints.request_stop()

    def _restore(self, info: CheckpointInfo) -> None:
        self.checkpoints.restore(info)

    def _controller_state(self, step: int, version: int, seconds: float, unfinished: list[dict]) -> dict:
        return self.checkpoints.state(step, version, seconds, unfinished)

    def _load_controller_state(self, state: dict) -> None:
        self.checkpoints.load_state(state)

    # -- evaluation and the training step ---------------------------------------------------
    async def evaluate(self, step: int) -> float:
        """Greedy accuracy (mean reward) on the held-out rows; with ``eval.samples`` also the
        policy's expected held-out reward: the mean reward of that many completions per row
        sampled at the rollout temperature (what RL raises first, before the argmax moves).

        Each evaluation, the one before step 0 too, has ``eval.timeout_minutes``: past it the
        evaluation is stopped (its requests cancelled), reported as ``eval/timed_out`` 1 at
        ``step`` with none of its other metrics (a part of the prompts, the quick ones,
        would read as a score), and NaN is returned. The run goes on: an evaluation only
        observes the training, and a run failed here could not be resumed with other
        evaluation settings (a resumed run keeps its spec)."""
        if not self.eval_rows and not self.eval_sets.sets:
            return float("nan")
        self.fleet.live_engine()  # fails clearly if every engine is dead
        evaluating = EVALUATING.set(True)
        limit_s = self.spec.eval.timeout_minutes * 60
        try:
            async with asyncio.timeout(limit_s) as deadline:
                with self.times.track("eval"):
                    return await self._evaluate(step)
        except TimeoutError:
            if not deadline.expired():  # a timeout of the evaluation's own calls: its error
                raise
            logger.warning("the evaluation at step %d did not finish within eval.timeout_minutes (%g): stopped, "
                           "reported as eval/timed_out, and the run goes on; lower eval.prompts, eval.samples or "
                           "the sets' prompts or n, or raise the timeout", step, self.spec.eval.timeout_minutes)
            self.last_sampled_reward = None
            self.reporter.log(step, {"eval/timed_out": 1.0})
            return float("nan")
        finally:
            EVALUATING.reset(evaluating)

    async def _evaluate(self, step: int) -> float:
        accuracy, metrics = float("nan"), {}
        if self.eval_rows:
            accuracy, metrics = await self._evaluate_greedy()
        metrics.update(await self.eval_sets.evaluate(self.fleet, self.rewards))  # eval.sets: pass@k, avg@n
        self.reporter.log(step, metrics)
        return accuracy

    async def _evaluate_greedy(self) -> tuple[float, dict[str, float]]:
        engines = [e for e in self.engines if not e.dead]
        sample = self.fleet.sample
        samples = await asyncio.gather(*(sample(engines[i % len(engines)], r, 0.0)
                                         for i, r in enumerate(self.eval_rows)))
        accuracy = sum(s.reward for s in samples) / len(samples)
        metrics = {"eval/accuracy": accuracy,  # a summed reward's components too, e.g. a rule at weight 0
                   **{f"eval/part/{name}": sum(s.parts.get(name, 0.0) for s in samples) / len(samples)
                      for name in samples[0].parts}}
        k = self.spec.eval.samples
        if k:
            temperature = self.spec.rollout.temperature
            sampled = await asyncio.gather(*(sample(engines[i % len(engines)], r, temperature)
                                             for i, r in enumerate(self.eval_rows) for _ in range(k)))
            self.last_sampled_reward = sum(s.reward for s in sampled) / len(sampled)
            metrics["eval/sampled_reward"] = self.last_sampled_reward
        return accuracy, metrics

    async def _train_on(self, groups: list[Group], step: int, t_start: float,
                        stats: Optional[dict] = None) -> None:
        """Train on a batch (unless a streamed step already did: ``stats``), push the new
        weights to every engine, and report the step."""
        spec = self.spec
        version = self.trainer.version - (1 if stats is not None else 0)
        # an episode counts by its oldest trained (generated) token (async_schedule.py)
        staleness = [version - oldest_trained_version(s.completion, g.start_version) for g in groups for s in g.samples]
        exactness = self._token_exactness(groups)  # before the step, on what it is about to train
        # colocated GPU plans: the engines' memory is the trainer's during its step
        sleeps = self.processes.plan is not None and self.processes.plan.sleeps and stats is None
        if stats is None:
            batch = [t for g in groups for t in self._train_samples(g)]
            sleep_s = await self.fleet.sleep() if sleeps else 0.0
            stats = await self._in_trainer(self.trainer.train_step, batch)
        stats = {**stats, **exactness}
        if self.processes.critic_stage is not None:  # samples valued from here on see the stepped critic
            lags = [version - s.values_version for g in groups for s in g.samples]
            stats = {**stats, "critic_stage/lag": sum(lags) / max(1, len(lags)),
                     "critic_stage/reload_s": await self._load_critic_stage()}
        if sleeps:  # the weights first, so the update lands while the KV cache still sleeps
            stats = {**stats, "engine/sleep_s": sleep_s, "engine/wake_s": await self.fleet.wake_up(["weights"])}
        timings = await self._send_weights(self.trainer.version)
        if sleeps:
            stats["engine/wake_s"] += await self.fleet.wake_up()
        self.gate.advance(self.trainer.version)
        self.fleet.after_step()
        # the step ends with its weight update; the trainer's own split goes into time/*
        stats = {**{k: v for k, v in stats.items() if k not in ("trainer/backward_s", "trainer/optimizer_s")},
                 **self.times.step(stats)}
        postfix = self.metrics.report_step(step, groups, staleness, stats, timings, t_start,
                                           self.schedule.queue_depth() if self.schedule is not None else 0)
        self.metrics.collect_stalls()
        if spec.eval.every_steps and step % spec.eval.every_steps == 0 and step < spec.stop.max_steps:
            await self.evaluate(step)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(**postfix)

    def _out_of_time(self, t_start: float) -> bool:
        return self.stop.is_set() or (time.time() - t_start) / 60 > self.spec.stop.max_minutes

    # -- the run ------------------------------------------------------------------------------
    def engine_pools(self) -> dict:
        """rollout.share_engines: the shared engine pools this run is on, for the platform
        (from the heartbeat's thread: reads only)."""
        views = [e.pool for e in list(self.fleet.engines) if getattr(e, "pool", None) is not None]
        return {"engine_pools": [{"id": v.id, "share": v.share, "fair_share": v.fair_share} for v in views]} if views else {}

    async def run(self) -> RunResult:
        from tqdm import tqdm

        spec = self.spec
        exporters = self._open_exporters()
        failed = True
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
            self.metrics.busy_before = sum(e.busy_s for e in self.engines) - self.checkpoints.gen_busy_before
            if self.resume is None:
                self.trainer_busy_s = 0.0
            gate = self.gate
            self.times.gate_blocked = lambda: not gate.can_start()
            self.times.watch(self.engines)
            self.times.restart()
            self.schedule = SyncSchedule(self) if spec.schedule.mode == "sync" else AsyncSchedule(self)
            await self.schedule.run_steps(t_start)
            self.result.seconds = time.time() - t_start
            self.result.idle_generation = self.metrics.idle_generation(self.result.seconds)
            self.result.idle_training = self.metrics.idle_training(max(self.result.seconds, 1e-9))
            self.bar.close()
            if self._failure is not None:
                raise self._failure
            self.metrics.collect_stalls()
            self.result.accuracy_after = await self.evaluate(self.result.steps)
            self.result.sampled_reward_after = self.last_sampled_reward
            final = self.out / "final_model"
            await asyncio.to_thread(self.trainer.save, str(final))
            self.result.final_model = str(final)
            self.result.memory_peak_gib = self._memory_peaks()
            host = getattr(self.processes.plan, "host_memory", None)
            self.result.memory_plan_gib = host.by_process() if host is not None else {}
            failed = False
            return self.result
        finally:
            try:
                await self.close()
            finally:  # even when closing the processes fails: each exporter's run is ended
                if exporters is not None:  # the points queued are written, each exporter's run ended
                    self.reporter.exporters = None
                    self.result.exporters = await asyncio.to_thread(exporters.close, failed)

    def _open_exporters(self):
        """The spec's report.* exporters (workers/io/exporters.py), fed every point the
        reporter gets from here on; None without any. Imported only when asked for."""
        if not self.spec.report.enabled():
            return None
        from workers.io.exporters import open_exporters

        exporters = open_exporters(self.spec.report.model_dump(), self.out, self.spec.name, self.spec.to_dict(),
                                   resume_step=self.resume.step if self.resume is not None else None)
        self.reporter.exporters = exporters
        return exporters
