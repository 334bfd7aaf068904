"""Controller: turns a run spec into a trained policy by wiring the roles together.

- ``sync`` (sync_schedule.py): generate a whole batch → (scored as each sample finishes)
  → train → update.
- ``async`` (async_schedule.py): rollouts and training overlap. Admission
  (``StalenessGate``) bounds how far ahead generation may run; finished samples stream to
  the reward service and into a queue; the trainer steps as soon as it has a batch, then
  pushes weights into running engines with the spec's update mode (keep = in-flight,
  interrupt, drain).

The Controller owns the parts and the order they run in: the processes (processes.py),
the rollout fleet (generation.py), the data position (rows.py), the trainer's work
(trainer_work.py), the checkpoints (checkpointing.py), the step metrics
(step_metrics.py) and the evaluation (evaluation.py); it keeps the training step both
schedules share (``train_on``). Each part gets the other parts it uses, never the
Controller: the schedules get theirs as ``ScheduleParts`` (schedule_parts.py).

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
from pathlib import Path
from typing import Optional

from workers.agents.episode import oldest_trained_version
from workers.coord.async_schedule import AsyncSchedule
from workers.coord.checkpointing import CheckpointParts, Checkpointer
from workers.coord.evaluation import EvalSets, Evaluator
from workers.coord.generation import Fleet, Group, Sample
from workers.coord.length_ranker import LengthRanker
from workers.coord.processes import Processes, placement
from workers.coord.rows import RowSource
from workers.coord.schedule_parts import ScheduleParts
from workers.coord.step_metrics import RunResult, StepMetrics, memory_peaks
from workers.coord.sync_schedule import SyncSchedule
from workers.coord.time_breakdown import TimeBreakdown
from workers.coord.trainer_work import TrainerError, TrainerWork
from workers.io.checkpoint import CheckpointInfo
from workers.io.report import Reporter
from workers.models.preflight import check_run, resolve_model_path
from workers.models.reward_model import resolve_reward_model_path
from workers.rollout.engine import RolloutEngine
from workers.rollout.engine_types import Completion
from workers.rollout.staleness import StalenessGate
from workers.spec import RunSpec
from workers.tasks.datasets import load_rows
from workers.weights.files import trainer_weight_file
from workers.weights.update import FileWeights

__all__ = ["Controller", "Group", "RunResult", "Sample", "TrainerError"]

logger = logging.getLogger(__name__)


class Controller:
    """One run: its parts (``processes``, ``fleet``, ``data``, ``work``, ``checkpoints``,
    ``metrics``, ``evaluation``, ``times``) and the order they run in. The seams a
    subclass may override: ``_generate``, ``_score``, ``_send_weights`` and ``train_on``."""

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
        rng = random.Random(spec.seed)  # the row order's and dispatch's: one state in a checkpoint
        self.data = RowSource(rng)  # the training rows and the data position (rows.py)
        self.ranker = LengthRanker()
        self.resume = resume  # a checkpoint to continue from (workers/io/checkpoint.py)
        self.eval_sets = EvalSets(spec)  # eval.sets: pass@k and avg@n per held-out set (evaluation.py)
        self.bar = None  # the progress bar, while the schedule runs
        self.schedule: Optional[SyncSchedule | AsyncSchedule] = None
        self.processes = Processes(spec, self.out, self.rendezvous, self._lost_node)
        # _generate and _score through the Controller: a subclass that overrides them sees every sample
        self.fleet = Fleet(spec, self.ranker, rng, generate=self._generate, score=self._score)
        self.times = TimeBreakdown()  # each step's time/<part>_s (time_breakdown.py)
        self.work = TrainerWork(spec, self.processes, self.times)  # the trainer, its calls timed
        self.metrics = StepMetrics(spec, self.fleet, self.result, self.reporter, self.ranker, self.work)
        self.evaluation = Evaluator(spec, self.fleet, self.eval_sets, self.reporter, self.times)  # evaluation.py
        # on_checkpoint(step, version, path): called after each save
        self.checkpoints = Checkpointer(CheckpointParts(
            spec, self.out, self.result, self.stop, self.data, self.ranker, self.work,
            lambda: self.metrics.gen_busy() - self.metrics.busy_before, self.fleet, resume, on_checkpoint))

    # -- set-up -------------------------------------------------------------------
    def _placement(self):
        return placement(self.spec)

    async def setup(self) -> None:
        spec = self.spec
        t = spec.task
        train_rows, held_out = load_rows(t.dataset, t.size, t.eval_size, t.seed, t.prompt_field, t.answer_field)
        eval_rows = held_out[: spec.eval.prompts]
        set_rows = self.eval_sets.load(held_out)  # copies: told apart from eval_rows by identity below
        # The model's tokenizer, stop ids and limits, checked before any process starts.
        spec.model.path = await asyncio.to_thread(resolve_model_path, spec.model.path)
        if spec.reward.model is not None:
            spec.reward.model.path = await asyncio.to_thread(resolve_reward_model_path, spec.reward.model.path)
        # the sets' prompts are checked with the run's: max_model_len must hold them too
        checked = await asyncio.to_thread(check_run, spec, train_rows, eval_rows + set_rows)
        self.fleet.prompts = checked.renderer
        own = {id(r) for r in eval_rows}
        self.data.rows, self.evaluation.rows = checked.train_rows, [r for r in checked.eval_rows if id(r) in own]
        self.eval_sets.keep(checked.eval_rows)
        self.result.skipped_prompts = sum(checked.skipped.values())
        if t.environment is not None and self.data.rows and checked.renderer.is_chat(self.data.rows[0]):
            # the observations' chat deltas: a template that is not prefix-stable fails here, before any process
            await asyncio.to_thread(self.fleet.observations().prepare)
        self.processes.start(self._placement)
        self.fleet.rewards = self.processes.rewards
        self.eval_sets.start_rewards()
        collective = spec.rollout.weight_transport == "collective"
        beside = self.processes.starts_beside_trainer()
        starting = None
        if beside:  # the engines start while the trainer loads; the trainer's weights follow as an update
            self.fleet.add(self.processes.engines(checked))  # in the fleet before they start: close() stops them
            starting = asyncio.ensure_future(self.processes.start_engines(self.fleet.engines, None, 0, together=True))
        try:
            await self.processes.start_trainer(checked)
            trainer = self.processes.trainer
            self.fleet.reference = self.processes.reference  # None unless algorithm.kl_reference is 'stage'
            self.fleet.critic = self.processes.critic_stage  # None unless critic.forward is 'stage'
            if self.resume is not None:
                await asyncio.to_thread(self.checkpoints.restore, self.resume)
            await self.work.load_critic_stage()  # before the first sample is valued, resumed or not
        except BaseException:
            if starting is not None:  # close() then stops what did start
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
            raise
        # the collective path needs the file only for the resume check
        rpc_warm = not collective and not beside  # the RPC path's first weights ride on the engines' start
        with tempfile.TemporaryDirectory(prefix="fluxrl-weights-") as folder:
            warm = (await asyncio.to_thread(trainer_weight_file, trainer, folder, trainer.version)
                    if rpc_warm or self.resume is not None else None)
            if beside:
                await starting
                if not collective:  # the first weights (and version label), as the collective path sends them
                    await self._send_weights(trainer.version)
            else:
                self.fleet.add(self.processes.engines(checked))  # in the fleet before they start: close() stops them
                # the warm weights are the first update: on resume, the checkpoint's weights and version
                await self.processes.start_engines(self.fleet.engines, None if collective else FileWeights.of(warm),
                                                   0 if collective else trainer.version)
            if collective:  # the first weights (and version label) come through the group
                broadcaster = await self.processes.open_weight_group(self.fleet.engines)
                self.fleet.weights.broadcaster = broadcaster
                broadcaster.digest_next = self.resume is not None  # checked by note_resume
                await self._send_weights(trainer.version)
            if self.resume is not None:
                await self.checkpoints.note_resume(warm)

    def _lost_node(self, error: BaseException) -> None:
        """A node of a run over several nodes is gone (called in the loop): the run fails."""
        self._fail(TrainerError(f"the run lost a node: {error}"))

    def _fail(self, error: BaseException) -> None:
        """The run fails with ``error`` (the first one wins): the schedule stops, run() raises it."""
        self._failure = self._failure or error
        self.stop.set()

    async def close(self) -> None:
        self.processes.close(self.fleet.engines + self.fleet.dead, self.fleet.weights.broadcaster)
        self.eval_sets.close()

    # -- the fleet's seams (a subclass may override these) ---------------------------------
    async def _generate(self, engine: RolloutEngine, row: dict, temperature: float) -> Completion:
        return await self.fleet.generate(engine, row, temperature)

    async def _score(self, row: dict, comp: Completion) -> Sample:
        with self.times.track("scoring"):
            return await self.fleet.score(row, comp)

    async def _send_weights(self, version: int) -> list:
        with self.times.track("weight_update"):
            return await self.fleet.send_weights(self.processes.trainer, version)

    def _one_request_per_group(self, engine: RolloutEngine) -> bool:
        return self.fleet.one_request_per_group(engine)

    # -- checkpoints (checkpointing.py) ----------------------------------------------------
    def request_checkpoint_and_stop(self) -> None:
        """SIGTERM: finish the step in progress, save a checkpoint after it (whatever
        trainer.checkpoint_every says) and stop; a second request, or one before any step
        was trained here, stops at once."""
        self.checkpoints.request_stop()

    # -- the training step ------------------------------------------------------------------
    async def train_on(self, groups: list[Group], step: int, t_start: float,
                       stats: Optional[dict] = None) -> None:
        """The training step both schedules share: train on a batch (unless a streamed step
        already did: ``stats``), push the new weights to every engine, and report the step."""
        spec, trainer = self.spec, self.processes.trainer
        version = trainer.version - (1 if stats is not None else 0)
        # an episode counts by its oldest trained (generated) token (async_schedule.py)
        staleness = [version - oldest_trained_version(s.completion, g.start_version) for g in groups for s in g.samples]
        exactness = self.work.token_exactness(groups)  # before the step, on what it is about to train
        # colocated GPU plans: the engines' memory is the trainer's during its step
        sleeps = self.processes.plan is not None and self.processes.plan.sleeps and stats is None
        if stats is None:
            batch = [t for g in groups for t in self.work.samples(g)]
            sleep_s = await self.fleet.sleep() if sleeps else 0.0
            stats = await self.work.run(trainer.train_step, batch)
        stats = {**stats, **exactness}
        if self.processes.critic_stage is not None:  # samples valued from here on see the stepped critic
            lags = [version - s.values_version for g in groups for s in g.samples]
            stats = {**stats, "critic_stage/lag": sum(lags) / max(1, len(lags)),
                     "critic_stage/reload_s": await self.work.load_critic_stage()}
        if sleeps:  # the weights first, so the update lands while the KV cache still sleeps
            stats = {**stats, "engine/sleep_s": sleep_s, "engine/wake_s": await self.fleet.wake_up(["weights"])}
        timings = await self._send_weights(trainer.version)
        if sleeps:
            stats["engine/wake_s"] += await self.fleet.wake_up()
        self.gate.advance(trainer.version)
        self.fleet.after_step()
        # the step ends with its weight update; the trainer's own split goes into time/*
        stats = {**{k: v for k, v in stats.items() if k not in ("trainer/backward_s", "trainer/optimizer_s")},
                 **self.times.step(stats)}
        postfix = self.metrics.report_step(step, groups, staleness, stats, timings, t_start,
                                           self.schedule.queue_depth() if self.schedule is not None else 0)
        self.metrics.collect_stalls()
        if spec.eval.every_steps and step % spec.eval.every_steps == 0 and step < spec.stop.max_steps:
            await self.evaluation.evaluate(step)
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
                self.result.accuracy_before = await self.evaluation.evaluate(0)
                self.result.sampled_reward_before = self.evaluation.last_sampled_reward
            self.gate = StalenessGate(spec.schedule.batch_prompts,
                                      0 if spec.schedule.mode == "sync" else spec.schedule.max_staleness)
            # Resumed: the checkpoint's batches count as trained, so admission starts where it was.
            self.gate.advance(self.processes.trainer.version)
            self.gate.finished = (self.checkpoints.first_step - 1) * spec.schedule.batch_prompts
            self.bar = tqdm(total=spec.stop.max_steps, initial=self.checkpoints.first_step - 1,
                            desc=f"{spec.name} [{spec.schedule.mode}]", unit="step", disable=not self.progress)
            # Resumed: times and totals continue from the checkpoint (throughput, idle
            # shares and stop.max_minutes count the training before it).
            t_start = time.time() - self.checkpoints.seconds_before
            # the evaluation above is not training time
            self.metrics.busy_before = sum(e.busy_s for e in self.fleet.engines) - self.checkpoints.gen_busy_before
            if self.resume is None:
                self.work.busy_s = 0.0
            gate = self.gate
            self.times.gate_blocked = lambda: not gate.can_start()
            self.times.watch(self.fleet.engines)
            self.times.restart()
            parts = ScheduleParts(spec, self.data.draw(), self.fleet, self.work, self.checkpoints, self.train_on,
                                  self._score, self._out_of_time, self.stop, self._fail, gate, self.result)
            self.schedule = SyncSchedule(parts) if spec.schedule.mode == "sync" else AsyncSchedule(parts)
            await self.schedule.run_steps(t_start)
            self.result.seconds = time.time() - t_start
            self.result.idle_generation = self.metrics.idle_generation(self.result.seconds)
            self.result.idle_training = self.metrics.idle_training(max(self.result.seconds, 1e-9))
            self.bar.close()
            if self._failure is not None:
                raise self._failure
            self.metrics.collect_stalls()
            self.result.accuracy_after = await self.evaluation.evaluate(self.result.steps)
            self.result.sampled_reward_after = self.evaluation.last_sampled_reward
            final = self.out / "final_model"
            await asyncio.to_thread(self.processes.trainer.save, str(final))
            self.result.final_model = str(final)
            self.result.memory_peak_gib = memory_peaks(self.processes, self.fleet.engines)
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
