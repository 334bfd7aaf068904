"""The rollout fleet: the run's engines as one pool that turns prompts into scored groups.

It chooses the engine for each prompt group (``schedule.dispatch``), generates the
group (one request of ``group_size`` samples, or a request per sample), finishes a
sequence elsewhere when its engine hands it off or dies, retires dead engines, pushes
the trainer's weights to the live ones, migrates a synchronous step's tail, and scores
samples with the reward service.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from dataclasses import dataclass, field
from typing import Optional

from workers.coord.length_ranker import LengthRanker
from workers.coord.scheduling import plan_dispatch, plan_tail_migration
from workers.rollout.engine import Completion, RolloutEngine, continue_on
from workers.spec import RunSpec
from workers.weights.broadcast import RankZeroSender, WeightBroadcaster, WeightBroadcastError
from workers.weights.sync import serialize_state_dict

logger = logging.getLogger(__name__)


# Set while the held-out evaluation generates (Controller.evaluate): its samples skip the
# inference stage's training-only forwards. A context variable, so only the evaluation's
# own tasks see it, not the rollouts generating beside it.
EVALUATING: contextvars.ContextVar[bool] = contextvars.ContextVar("fluxrl_evaluating", default=False)


async def _none() -> None:
    return None


@dataclass
class Sample:
    row: dict
    completion: Completion
    text: str
    reward: float
    error: Optional[str] = None
    parts: dict[str, float] = field(default_factory=dict)  # a summed reward's components, unweighted
    ref_logprobs: Optional[list[float]] = None  # algorithm.kl_reference stage: from the inference stage
    values: Optional[list[float]] = None  # critic.forward stage: the critic's values, from the inference stage
    values_version: int = -1  # the critic version that computed ``values``


@dataclass
class Group:
    samples: list[Sample]
    start_version: int
    index: int


class Fleet:
    """The live rollout engines (``engines``), the dead ones (``dead``, shut down at close)
    and what they generate.

    ``prompts`` (the model's prompt renderer) and ``rewards`` (the reward service) are set
    once they exist (``Controller.setup``). ``generate`` and ``score`` are what the fleet
    calls for each sample: by default its own, the Controller passes its ``_generate`` and
    ``_score`` so a subclass that overrides them sees every call."""

    def __init__(self, spec: RunSpec, ranker: LengthRanker, rng, generate=None, score=None):
        self.spec = spec
        self.ranker = ranker
        self._rng = rng  # the controller's: dispatch draws from the same sequence as the row order
        self._generate_fn = generate or self.generate
        self._score_fn = score or self.score
        self.prompts = None
        self.rewards = None
        self.reference = None  # algorithm.kl_reference stage: workers/train/reference.py ReferenceStage
        self.critic = None  # critic.forward stage: workers/train/value_stage.py ValueStage
        self.engines: list[RolloutEngine] = []
        self.load: dict[int, float] = {}  # engine index -> predicted tokens it is generating
        self.broadcaster: Optional[WeightBroadcaster] = None  # rollout.weight_transport: collective
        self.migrations = 0  # sequences moved to another engine (rollout.migrate_tail)
        # Rollout engines whose core process dies are taken out of service; their requests
        # continue on a live engine. (Restarting one in the same process is not done: a
        # restart attempt hung, see issue #7.)
        self.engine_deaths = 0
        self.dead: list[RolloutEngine] = []
        self.retired_tokens, self.retired_busy = 0, 0.0  # counters of dead engines

    def add(self, engines: list[RolloutEngine]) -> None:
        """Engines that started: into service, with no load yet."""
        self.engines = list(engines)
        for engine in self.engines:
            self.load[engine.index] = 0.0

    # -- dispatch ------------------------------------------------------------------
    def plan(self, rows: list[dict]) -> list[tuple[dict, RolloutEngine, float]]:
        """Dispatch order and engine for prompt groups (``schedule.dispatch``): predicted-long
        groups first and spread by predicted token load (longest_first), or as they come."""
        return [(rows[i], engine, predicted) for i, engine, predicted in self.plan_indexed(rows)]

    def plan_indexed(self, rows: list[dict], overdue: Optional[list[bool]] = None
                     ) -> list[tuple[int, RolloutEngine, float]]:
        """``plan`` as (index into ``rows``, engine, predicted tokens); ``overdue`` rows first."""
        policy, size = self.spec.schedule.dispatch, self.spec.algorithm.group_size
        if policy == "longest_first":
            predicted = [p * size for p in self.ranker.predict([r["prompt"] for r in rows])]
        else:
            predicted = [1.0] * len(rows)
        loads = [self.load[e.index] for e in self.engines]
        plan = plan_dispatch(policy, predicted, loads, seed=self._rng.randrange(2**31), overdue=overdue)
        return [(i, self.engines[e], predicted[i]) for i, e in plan]

    # -- samples and groups ----------------------------------------------------------
    async def generate(self, engine: RolloutEngine, row: dict, temperature: float) -> Completion:
        comp = await engine.generate(self.prompts.ids(row), self.spec.rollout.max_tokens, temperature)
        return await self.finish_elsewhere(engine, comp, temperature)

    async def score(self, row: dict, comp: Completion) -> Sample:
        text = self.prompts.decode(comp.token_ids)
        fields = {k: v for k, v in row.items() if k != "prompt"}
        if (self.reference is None and self.critic is None) or EVALUATING.get():  # held-out: not trained on
            score = await self.rewards.score(row["prompt"], text, fields)
            return Sample(row, comp, text, score.reward, score.error, score.parts)
        # the inference stage: the reference's and the critic's forwards beside the scoring, as the sample finishes
        score, ref, valued = await asyncio.gather(
            self.rewards.score(row["prompt"], text, fields),
            self.reference.logprobs(comp.prompt_ids, comp.token_ids) if self.reference is not None else _none(),
            self.critic.values(comp.prompt_ids, comp.token_ids) if self.critic is not None else _none())
        values, version = valued if valued is not None else (None, -1)
        return Sample(row, comp, text, score.reward, score.error, score.parts, ref, values, version)

    async def sample(self, engine: RolloutEngine, row: dict, temperature: float) -> Sample:
        return await self._score_fn(row, await self._generate_fn(engine, row, temperature))

    async def group(self, row: dict, index: int, start_version: int, engine: RolloutEngine,
                    predicted: float = 0.0, score: bool = True) -> Group:
        """One prompt's group. Scored sample by sample as each finishes (fused), or left
        for the caller to score after a barrier (``score=False``)."""
        self.load[engine.index] += predicted
        try:
            if self.one_request_per_group(engine):
                samples = await self._group_request(engine, row, self.spec.rollout.temperature, score)
            else:
                work = self.sample if score else self._generate_fn
                samples = await asyncio.gather(*(work(engine, row, self.spec.rollout.temperature)
                                                 for _ in range(self.spec.algorithm.group_size)))
        finally:
            self.load[engine.index] -= predicted
        lengths = [(s.completion if score else s).length for s in samples]
        self.ranker.observe_group(row["prompt"], lengths)
        return Group(list(samples), start_version, index)

    def one_request_per_group(self, engine: RolloutEngine) -> bool:
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
            comp = await self.finish_elsewhere(engine, comp, temperature)
            return await self._score_fn(row, comp) if score else comp

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

    # -- engines that hand off or die ---------------------------------------------------
    async def finish_elsewhere(self, engine: RolloutEngine, comp: Completion, temperature: float) -> Completion:
        """A sequence ``engine`` left unfinished (handed off, or the engine died), finished
        from its prefix by another engine; any other sequence as it is."""
        while comp.finish_reason in ("handed_off", "engine_died"):
            # migrated, or its engine died: finish it from its prefix on the idlest other live engine
            source = engine if comp.finish_reason == "handed_off" else None
            if comp.finish_reason == "engine_died":
                dead = next((e for e in self.engines + self.dead if e.index == comp.engine and e.dead), None)
                if dead is not None:
                    self.retire(dead, "its requests continue on the other engine(s)")
            target = self.live_engine(exclude=comp.engine, fallback=source)
            comp = await continue_on(target, comp, self.spec.rollout.max_tokens, temperature)
        return comp

    def live_engine(self, exclude: Optional[int] = None,
                    fallback: Optional[RolloutEngine] = None) -> RolloutEngine:
        """The idlest live engine other than ``exclude`` (else ``fallback``, else any live
        one); raises when every engine is dead."""
        live = [e for e in self.engines if not e.dead]
        others = [e for e in live if e.index != exclude]
        pool = others or ([fallback] if fallback is not None and not fallback.dead else live)
        if not pool:
            raise RuntimeError("every rollout engine died")
        return min(pool, key=lambda e: len(e.active))

    def retire(self, engine: RolloutEngine, why: str) -> None:
        """Take a dead engine out of service (once)."""
        if engine not in self.engines:
            return
        self.engines.remove(engine)
        self.engine_deaths += 1
        self.retired_tokens += engine.generated_tokens
        self.retired_busy += engine.busy_seconds()
        logger.warning("rollout engine %d died (EngineDeadError: its core process exited); %s; "
                       "%d engine(s) live", engine.index, why, len(self.engines))
        self.dead.append(engine)  # shut down at close

    # -- weights -------------------------------------------------------------------------
    async def _update(self, engine: RolloutEngine, blob, version: int):
        """Push weights (a blob, or a collective's share) to one engine; None if it died
        (it is retired; the others go on)."""
        try:
            return await engine.update_weights(blob, version)
        except Exception:
            if not engine.dead:
                raise
            self.retire(engine, "weight updates skip it")
            return None

    async def send_weights(self, trainer, version: int) -> list:
        """The trainer's weights to every live engine by ``rollout.weight_transport``; the
        timings of the engines that took them."""
        if self.broadcaster is None:
            blob = await asyncio.to_thread(serialize_state_dict, trainer.state_dict())
            results = await asyncio.gather(*(self._update(e, blob, version) for e in list(self.engines)))
            return [t for t in results if t is not None]
        remote = isinstance(self.broadcaster.sender, RankZeroSender)
        # in this process: the full weights (a collective of the ranks under ZeRO-3); with
        # rank 0 sending, it gathers them itself
        state = None if remote else await asyncio.to_thread(trainer.state_dict)
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

    # -- colocated plans: the engines sleep through the trainer's step ----------------------
    async def sleep(self) -> float:
        """Every live engine frees its GPU memory (vLLM sleep level 1); the seconds, the slowest's."""
        return max(await asyncio.gather(*(e.sleep() for e in list(self.engines))), default=0.0)

    async def wake_up(self, tags: Optional[list[str]] = None) -> float:
        """Every live engine wakes ``tags`` ("weights" before an update) or all; the slowest's seconds."""
        return max(await asyncio.gather(*(e.wake_up(tags) for e in list(self.engines))), default=0.0)

    # -- a synchronous step's tail ---------------------------------------------------------
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
    async def tail_migration(self):
        """Around a synchronous step's generation: migrate its tail while it runs."""
        migrator = None
        if self.spec.rollout.migrate_tail and len(self.engines) > 1:
            migrator = asyncio.create_task(self._migrate_tail())
        try:
            yield
        finally:
            if migrator is not None:
                migrator.cancel()
