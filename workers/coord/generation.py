"""The rollout fleet: the run's engines as one pool that turns prompts into scored groups.

It chooses the engine for each prompt group (``schedule.dispatch``), generates the
group (one request of ``group_size`` samples, or a request per sample), finishes a
sequence elsewhere when its engine hands it off or dies, retires dead engines, pushes
the trainer's weights to the live ones (weight_push.py), migrates a synchronous step's
tail (tail.py), and scores samples with the reward service. ``skew_aware`` dispatch
keeps its engine roles in long_tail.py.

With ``task.environment`` each sample is an episode (workers/agents/episode.py): turns
generated one request each, continued elsewhere like any request, with a fresh
environment per episode; never a parallel-sampling group request.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from workers.api import TrainEngine
from workers.coord.length_ranker import LengthRanker
from workers.coord.long_tail import LongTailRoles
from workers.coord.scheduling import LENGTH_AWARE, plan_dispatch, plan_skew_aware
from workers.coord.scheduling import priority as request_priority
from workers.coord.tail import TailMover
from workers.coord.weight_push import WeightPush
from workers.rewards.service import RewardService
from workers.rollout.engine import RolloutEngine, continue_on
from workers.rollout.engine_types import Completion
from workers.spec import RunSpec
from workers.tasks.prompts import PromptRenderer

logger = logging.getLogger(__name__)


# Set while the held-out evaluation generates (Evaluator.evaluate, evaluation.py): its samples skip the
# inference stage's training-only forwards. A context variable, so only the evaluation's
# own tasks see it, not the rollouts generating beside it.
EVALUATING: contextvars.ContextVar[bool] = contextvars.ContextVar("fluxrl_evaluating", default=False)
# The vLLM priority of the prompt group a task generates (schedule.dispatch skew_aware; 0
# otherwise, and for continuations and evaluation, which then go first). Set by ``group``
# for its own task, so the ``generate`` seam keeps its signature.
PRIORITY: contextvars.ContextVar[int] = contextvars.ContextVar("fluxrl_priority", default=0)


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
    # an episode: the reward GAE credits per token (workers/agents/episode.py token_rewards)
    token_rewards: Optional[list[float]] = None
    # wall times its scoring and inference-stage forwards began and were done (inference/overlap)
    inference_started_at: float = 0.0
    scored_at: float = 0.0


@dataclass(frozen=True)
class Dispatched:
    """Where and how a prompt group starts: its index in the rows planned, its engine, its
    predicted tokens and its vLLM priority (0 unless ``skew_aware``)."""
    index: int
    engine: RolloutEngine
    predicted: float
    priority: int = 0


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
        self.prompts: Optional[PromptRenderer] = None
        self.rewards: Optional[RewardService] = None
        self.reference = None  # algorithm.kl_reference stage: workers/train/reference.py ReferenceStage
        self.critic = None  # critic.forward stage: workers/train/value_stage.py ValueStage
        self.engines: list[RolloutEngine] = []
        self.load: dict[int, float] = {}  # engine index -> predicted tokens it is generating
        self.tail = TailMover(spec)  # rollout.migrate_tail, gather_tail (tail.py)
        # Rollout engines whose core process dies are taken out of service; their requests
        # continue on a live engine. (Restarting one in the same process is not done: vLLM's
        # engine core does not start again cleanly beside a dead one; an attempt hung.)
        self.engine_deaths = 0
        self.dead: list[RolloutEngine] = []
        self.retired_tokens, self.retired_busy = 0, 0.0  # counters of dead engines
        self.weights = WeightPush(self.retire)  # the trainer's weights to the engines (weight_push.py)
        self.roles = LongTailRoles(spec)  # skew_aware: the long-tail engines (long_tail.py)
        self._observations = None  # task.environment: the observation renderer, made on first use
        self._render_lock = asyncio.Lock()

    def add(self, engines: list[RolloutEngine]) -> None:
        """Engines that started: into service, with no load yet."""
        self.engines = list(engines)
        for engine in self.engines:
            self.load[engine.index] = 0.0

    # -- dispatch ------------------------------------------------------------------
    def plan(self, rows: list[dict]) -> list[tuple[dict, Dispatched]]:
        """Dispatch order and placement for prompt groups (``schedule.dispatch``)."""
        return [(rows[d.index], d) for d in self.plan_indexed(rows)]

    def plan_indexed(self, rows: list[dict], overdue: Optional[list[bool]] = None,
                     limit: Optional[int] = None) -> list[Dispatched]:
        """``plan`` by index into ``rows``, the first ``limit`` (those that start now);
        ``overdue`` rows first."""
        policy, size = self.spec.schedule.dispatch, self.spec.algorithm.group_size
        if policy in LENGTH_AWARE:
            predicted = [p * size for p in self.ranker.predict([r["prompt"] for r in rows])]
        else:
            predicted = [1.0] * len(rows)
        loads = [self.load[e.index] for e in self.engines]
        if policy != "skew_aware":
            plan = plan_dispatch(policy, predicted, loads, seed=self._rng.randrange(2**31), overdue=overdue)
            return [Dispatched(i, self.engines[e], predicted[i]) for i, e in plan[:limit]]
        cut = self.roles.long_tail_cut
        roles = self.roles.roles(self.engines)
        plan = plan_skew_aware(predicted, loads, [e.index in roles for e in self.engines],
                               cut.threshold(predicted), overdue)[:limit]
        cut.observe([predicted[i] for i, _ in plan])  # what starts now joins the recent predictions
        aging = self.spec.schedule.long_tail.aging or self.spec.schedule.batch_prompts
        out = []
        for i, e in plan:
            out.append(Dispatched(i, self.engines[e], predicted[i],
                                  request_priority(self.roles.dispatched, cut.percentile(predicted[i]), aging)))
            self.roles.dispatched += 1
        return out

    def after_step(self) -> None:
        """A step was trained: ``skew_aware`` measures the roles' rates and splits again."""
        if self.spec.schedule.dispatch == "skew_aware" and self.engines:
            self.roles.split(self.engines)

    def dispatch_metrics(self) -> dict[str, float]:
        """``dispatch/*`` for the step's report (skew_aware only)."""
        return self.roles.metrics() if self.spec.schedule.dispatch == "skew_aware" else {}

    # -- samples and groups ----------------------------------------------------------
    async def generate(self, engine: RolloutEngine, row: dict, temperature: float) -> Completion:
        if self.spec.task.environment is not None:
            return await self.episode(engine, row, temperature)
        comp = await engine.generate(self.prompts.ids(row), self.spec.rollout.max_tokens, temperature,
                                     priority=PRIORITY.get())
        self.tail.request_ended.set()  # the tail gatherer looks again
        return await self.finish_elsewhere(engine, comp, temperature)

    def observations(self):
        """The run's observation renderer (workers/agents/render.py), made once."""
        if self._observations is None:
            from workers.agents.render import ObservationRenderer

            self._observations = ObservationRenderer.for_prompts(self.prompts)
        return self._observations

    async def episode(self, engine: RolloutEngine, row: dict, temperature: float) -> Completion:
        """One episode (task.environment): a fresh environment, turns generated on ``engine``
        (a turn its engine hands off or loses is finished elsewhere, and the next turn goes
        to a live engine), observations rendered by the model's chat template."""
        from workers.agents.builtin import make_environment
        from workers.agents.episode import Budgets, run_episode

        env_spec, rollout = self.spec.task.environment, self.spec.rollout
        chat = self.prompts.is_chat(row)
        renderer = self.observations()
        if chat and not renderer.prepared:  # the template's deltas render in a child process: once, off the loop
            async with self._render_lock:
                if not renderer.prepared:
                    await asyncio.to_thread(renderer.prepare)
        current = engine

        async def turn(ids: list[int], max_tokens: int) -> Completion:
            nonlocal current
            if current.dead:
                current = self.live_engine(exclude=current.index)
            comp = await current.generate(ids, max_tokens, temperature, priority=PRIORITY.get())
            self.tail.request_ended.set()
            comp = await self.finish_elsewhere(current, comp, temperature, max_tokens)
            return comp

        env = make_environment(env_spec, model_path=self.spec.model.path)
        # the engines' context (preflight sized it for prompt + episode, within the model's)
        context = engine.max_model_len
        budgets = Budgets.of(env_spec, rollout.max_tokens, context)
        return await run_episode(turn, env, row, self.prompts.ids(row), budgets, renderer, chat)

    async def _score_text(self, row: dict, comp: Completion, text: str):
        """The reward section's score of ``text``, or, for an episode, of what
        ``task.environment.rewards`` says: its last generated turn (final), its turn rewards
        (turns) or both; with the episode's per-token rewards for GAE."""
        fields = {k: v for k, v in row.items() if k != "prompt"}
        if comp.episode is None:
            return await self.rewards.score(row["prompt"], text, fields), None
        from workers.agents.episode import episode_reward, last_turn_text, token_rewards
        from workers.rewards.service import Score

        mode = self.spec.task.environment.rewards
        final = (await self.rewards.score(row["prompt"], last_turn_text(comp.episode), fields)
                 if mode != "turns" else Score(0.0))
        reward = episode_reward(comp.episode, final.reward, mode)
        return (Score(reward, final.error, final.parts), token_rewards(comp.episode, final.reward, mode))

    async def score(self, row: dict, comp: Completion) -> Sample:
        began = time.time()
        text = self.prompts.decode(comp.token_ids)
        if (self.reference is None and self.critic is None) or EVALUATING.get():  # held-out: not trained on
            score, per_token = await self._score_text(row, comp, text)
            return Sample(row, comp, text, score.reward, score.error, score.parts, inference_started_at=began,
                          scored_at=time.time(), token_rewards=per_token)
        # the inference stage: the reference's and the critic's forwards beside the scoring, as the sample finishes
        (score, per_token), ref, valued = await asyncio.gather(
            self._score_text(row, comp, text),
            self.reference.logprobs(comp.prompt_ids, comp.token_ids) if self.reference is not None else _none(),
            self.critic.values(comp.prompt_ids, comp.token_ids) if self.critic is not None else _none())
        values, version = valued if valued is not None else (None, -1)
        return Sample(row, comp, text, score.reward, score.error, score.parts, ref_logprobs=ref, values=values,
                      values_version=version, token_rewards=per_token, inference_started_at=began,
                      scored_at=time.time())

    async def sample(self, engine: RolloutEngine, row: dict, temperature: float) -> Sample:
        return await self._score_fn(row, await self._generate_fn(engine, row, temperature))

    async def group(self, row: dict, index: int, start_version: int, engine: RolloutEngine,
                    predicted: float = 0.0, score: bool = True, priority: int = 0) -> Group:
        """One prompt's group. Scored sample by sample as each finishes (fused), or left
        for the caller to score after a barrier (``score=False``). ``priority``: its
        requests' vLLM priority (``skew_aware``)."""
        token = PRIORITY.set(priority)  # seen by this call's requests, and only by them
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
            PRIORITY.reset(token)
        lengths = [(s.completion if score else s).length for s in samples]
        self.ranker.observe_group(row["prompt"], lengths)
        return Group(list(samples), start_version, index)

    def one_request_per_group(self, engine: RolloutEngine) -> bool:
        """Whether a prompt group goes to its engine as one request of ``group_size``
        samples (vLLM parallel sampling: one request's overhead instead of one per sample).
        Not where each sample must be a request of its own: interrupt updates resubmit each
        sequence from its prefix, and the tail migrator (rollout.migrate_tail) hands off
        single requests (and the tail gatherer). ``rollout.group_requests: false`` sends per-sample requests
        everywhere (to measure the difference). Nor episodes (task.environment): each is turns of its own."""
        rollout = self.spec.rollout
        return (self.spec.algorithm.group_size > 1 and self.spec.task.environment is None
                and rollout.group_requests and engine.update_mode != "interrupt"
                and not rollout.migrate_tail and not rollout.gather_tail)

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
                                                               self.spec.rollout.max_tokens, temperature,
                                                               priority=PRIORITY.get())) as done:
                async for index, comp in done:
                    finishing[index] = asyncio.ensure_future(finish(comp))
            return list(await asyncio.gather(*(finishing[i] for i in sorted(finishing))))
        finally:
            for task in finishing.values():  # left running only by an error or a cancellation
                task.cancel()

    # -- engines that hand off or die ---------------------------------------------------
    async def finish_elsewhere(self, engine: RolloutEngine, comp: Completion, temperature: float,
                               max_tokens: Optional[int] = None) -> Completion:
        """A sequence ``engine`` left unfinished (handed off, or the engine died), finished
        from its prefix by another engine; any other sequence as it is. ``max_tokens``: the
        sequence's budget (default rollout.max_tokens; an episode's turn has its own)."""
        while comp.finish_reason in ("handed_off", "engine_died"):
            # migrated, or its engine died: finish it from its prefix on the idlest other live engine
            source = engine if comp.finish_reason == "handed_off" else None
            if comp.finish_reason == "engine_died":
                dead = next((e for e in self.engines + self.dead if e.index == comp.engine and e.dead), None)
                if dead is not None:
                    self.retire(dead, "its requests continue on the other engine(s)")
            target = self.live_engine(exclude=comp.engine, fallback=source)
            onto = next((e for e in self.engines if e.index == self.tail.gather_onto and not e.dead), None)
            if comp.finish_reason == "handed_off" and onto is not None and onto.index != comp.engine:
                target = onto  # gathered: the whole tail onto one engine
            comp = await continue_on(target, comp, max_tokens or self.spec.rollout.max_tokens, temperature)
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
    async def send_weights(self, trainer: TrainEngine, version: int) -> list:
        """The trainer's weights to every live engine (weight_push.py); the timings of those that took them."""
        return await self.weights.send(self.engines, trainer, version)

    # -- colocated plans: the engines sleep through the trainer's step ----------------------
    async def sleep(self) -> float:
        """Every live engine frees its GPU memory (vLLM sleep level 1); the seconds, the slowest's."""
        return max(await asyncio.gather(*(e.sleep() for e in list(self.engines))), default=0.0)

    async def wake_up(self, tags: Optional[list[str]] = None) -> float:
        """Every live engine wakes ``tags`` ("weights" before an update) or all; the slowest's seconds."""
        return max(await asyncio.gather(*(e.wake_up(tags) for e in list(self.engines))), default=0.0)

    def tail_migration(self):
        """Around a synchronous step's generation: migrate or gather its tail (tail.py)."""
        return self.tail.during(self.engines)
