"""Evaluation sets (``eval.sets``): held-out sets scored the way RL results are reported.

Each set has its own rows (a JSONL file, a generator, or the run's held-out split) and its
own reward. Every evaluation samples ``n`` completions per prompt at the set's temperature,
one vLLM request per prompt (parallel sampling, ``SamplingParams.n``), prompts spread over
the live engines, and reports per set (docs/architecture.md §5):

- ``eval/<set>/pass@<k>``: the unbiased estimator of Chen et al. 2021 ("Evaluating Large
  Language Models Trained on Code", eq. 1), 1 - C(n-c, k) / C(n, k) per prompt with c of
  its n samples passing (reward >= ``pass_reward``), averaged over prompts;
- ``eval/<set>/avg@<n>``: the mean reward of the n samples, averaged over prompts (verl's
  mean@N, AReaL's avg@32).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Optional

from workers.coord.generation import EVALUATING, Fleet
from workers.coord.time_breakdown import TimeBreakdown
from workers.io.report import Reporter
from workers.rewards.service import RewardService
from workers.spec import EvalSetSpec, RunSpec
from workers.tasks.datasets import load_rows

logger = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k samples drawn without replacement from n,
    c of them correct, is correct: 1 - C(n-c, k) / C(n, k), computed as Chen et al.'s
    numerically stable product 1 - prod_{i=n-c+1..n} (1 - k/i)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def mean_pass_at_k(correct: list[int], n: int, k: int) -> float:
    """pass@k averaged over prompts, each with ``correct[j]`` of its n samples correct."""
    return sum(pass_at_k(n, c, k) for c in correct) / len(correct)


@dataclass
class EvalSet:
    """One set ready to evaluate: its spec, its rows (checked to fit the model) and the
    reward service that scores it (the run's own unless the set has a reward)."""
    spec: EvalSetSpec
    rows: list[dict]
    rewards: Optional[RewardService] = None  # None: the run's
    own_rewards: bool = False  # started for this set: closed with it


def load_set_rows(spec: RunSpec, one: EvalSetSpec, held_out: list[dict]) -> list[dict]:
    """The set's rows: its dataset's (every row of a file, ``size`` of a generator) or the
    run's held-out split, the first ``prompts`` of them."""
    if one.dataset is None:
        rows = held_out
    else:
        rows, _ = load_rows(one.dataset, one.size, 0, one.seed, one.prompt_field, one.answer_field)
    return [dict(r) for r in rows[: one.prompts]]  # copies: the check keeps a set's rows apart by identity


def set_metrics(name: str, n: int, ks: list[int], rewards: list[list[float]], pass_reward: float) -> dict[str, float]:
    """A set's metrics from each prompt's n rewards."""
    correct = [sum(1 for r in per_prompt if r >= pass_reward) for per_prompt in rewards]
    metrics = {f"eval/{name}/pass@{k}": mean_pass_at_k(correct, n, k) for k in ks}
    metrics[f"eval/{name}/avg@{n}"] = sum(sum(p) / n for p in rewards) / len(rewards)
    return metrics


class EvalSets:
    """The run's evaluation sets: loaded at set-up, evaluated at every evaluation, closed
    with the run. ``fleet`` is the rollout fleet (its prompts renderer and engines)."""

    def __init__(self, spec: RunSpec):
        self.spec = spec
        self.sets: list[EvalSet] = []

    def load(self, held_out: list[dict]) -> list[dict]:
        """Every set's rows (the run's held-out split for a set without a dataset); returns
        them all, to be checked against the model with the run's own rows."""
        self.sets = [EvalSet(one, load_set_rows(self.spec, one, held_out)) for one in self.spec.eval.sets]
        return [row for s in self.sets for row in s.rows]

    def keep(self, checked_rows: list[dict]) -> None:
        """Only the rows the model check kept (prompts that fit max_model_len), by identity."""
        kept = {id(r) for r in checked_rows}
        for s in self.sets:
            before = len(s.rows)
            s.rows = [r for r in s.rows if id(r) in kept]
            if not s.rows:
                logger.warning("eval set %s has no prompts to evaluate (%d too long for max_model_len): it reports "
                               "nothing", s.spec.name, before)
            elif len(s.rows) < before:
                logger.warning("eval set %s: %d of %d prompts are too long for max_model_len and are left out",
                               s.spec.name, before - len(s.rows), before)

    def start_rewards(self) -> None:
        """A reward service for each set with a reward of its own (a sandbox for user code)."""
        for s in self.sets:
            if s.spec.reward is not None:
                s.rewards, s.own_rewards = RewardService(s.spec.reward), True

    def close(self) -> None:
        for s in self.sets:
            if s.own_rewards and s.rewards is not None:
                s.rewards.close()

    async def evaluate(self, fleet, run_rewards: Optional[RewardService]) -> dict[str, float]:
        """Every set's metrics, the sets one after another (each one's prompts at once);
        ``run_rewards``: the run's reward service (set once started), for a set without its own."""
        metrics: dict[str, float] = {}
        for s in self.sets:
            if s.rows:
                rewards = s.rewards or run_rewards
                assert rewards is not None  # the run's is started before any evaluation
                metrics.update(await self._evaluate_set(fleet, s, rewards))
        return metrics

    async def _evaluate_set(self, fleet, s: EvalSet, rewards: RewardService) -> dict[str, float]:
        one = s.spec
        temperature = self.spec.rollout.temperature if one.temperature is None else one.temperature
        engines = [e for e in fleet.engines if not e.dead]
        if not engines:
            raise RuntimeError("every rollout engine died")

        async def prompt_rewards(i: int, row: dict) -> list[float]:
            engine = engines[i % len(engines)]
            comps = await self._sample(fleet, engine, row, one.n, temperature)
            fields = {k: v for k, v in row.items() if k != "prompt"}
            scores = await asyncio.gather(*(rewards.score(row["prompt"], fleet.prompts.decode(c.token_ids), fields)
                                            for c in comps))
            return [score.reward for score in scores]

        per_prompt = await asyncio.gather(*(prompt_rewards(i, r) for i, r in enumerate(s.rows)))
        return set_metrics(one.name, one.n, one.k, list(per_prompt), one.pass_reward)

    @staticmethod
    async def _sample(fleet, engine, row: dict, n: int, temperature: float) -> list:
        """n completions of a row: one request of n samples (vLLM parallel sampling), or a
        request each where an engine resumes sequences one by one (update_mode interrupt)."""
        if n > 1 and engine.update_mode != "interrupt":
            comps = await engine.generate_group(fleet.prompts.ids(row), n, fleet.spec.rollout.max_tokens,
                                                temperature)
            return list(await asyncio.gather(*(fleet.finish_elsewhere(engine, c, temperature) for c in comps)))
        return list(await asyncio.gather(*(fleet.generate(engine, row, temperature) for _ in range(n))))


class Evaluator:
    """The run's evaluations: greedy accuracy on the held-out ``rows`` (set once checked,
    Controller.setup), ``eval.samples``' sampled reward, and the ``eval.sets``
    (``eval_sets``). Receives the run's ``spec``, its ``fleet`` (engines, sampling,
    reward service), the ``reporter`` the metrics go to and the step's ``times``."""

    def __init__(self, spec: RunSpec, fleet: Fleet, eval_sets: EvalSets, reporter: Reporter, times: TimeBreakdown):
        self.spec, self.fleet, self.eval_sets, self.reporter, self.times = spec, fleet, eval_sets, reporter, times
        self.rows: list[dict] = []
        self.last_sampled_reward: Optional[float] = None  # of the latest evaluation (eval.samples)

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
        if not self.rows and not self.eval_sets.sets:
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
        accuracy, metrics = float("nan"), dict[str, float]()
        if self.rows:
            accuracy, metrics = await self._evaluate_greedy()
        metrics.update(await self.eval_sets.evaluate(self.fleet, self.fleet.rewards))  # eval.sets: pass@k, avg@n
        self.reporter.log(step, metrics)
        return accuracy

    async def _evaluate_greedy(self) -> tuple[float, dict[str, float]]:
        engines = [e for e in self.fleet.engines if not e.dead]
        sample = self.fleet.sample
        samples = await asyncio.gather(*(sample(engines[i % len(engines)], r, 0.0)
                                         for i, r in enumerate(self.rows)))
        accuracy = sum(s.reward for s in samples) / len(samples)
        metrics = {"eval/accuracy": accuracy,  # a summed reward's components too, e.g. a rule at weight 0
                   **{f"eval/part/{name}": sum(s.parts.get(name, 0.0) for s in samples) / len(samples)
                      for name in samples[0].parts}}
        k = self.spec.eval.samples
        if k:
            temperature = self.spec.rollout.temperature
            sampled = await asyncio.gather(*(sample(engines[i % len(engines)], r, temperature)
                                             for i, r in enumerate(self.rows) for _ in range(k)))
            self.last_sampled_reward = sum(s.reward for s in sampled) / len(sampled)
            metrics["eval/sampled_reward"] = self.last_sampled_reward
        return accuracy, metrics
