"""A run's total work: the most tokens its spec lets it generate, by what generates them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.spec.evaluation import EvalSetSpec
    from workers.spec.run import RunSpec


@dataclass(frozen=True)
class RunWork:
    """The most tokens a run can generate (every completion at rollout.max_tokens), by what
    generates them; the platform's per-run ceilings bound these (fluxrl/quotas/services.py)."""
    training: int  # stop.max_steps x schedule.batch_prompts x algorithm.group_size x max_tokens
    evaluations: int  # before step 0, every eval.every_steps before the last step, after the last step
    greedy: int  # one evaluation's held-out prompts x (1 greedy + eval.samples) x max_tokens
    sets: tuple[int, ...]  # one evaluation of each eval set: its prompts x n x max_tokens

    @property
    def per_evaluation(self) -> int:
        return self.greedy + sum(self.sets)

    @property
    def evaluation_total(self) -> int:
        return self.per_evaluation * self.evaluations

    @property
    def total(self) -> int:
        return self.training + self.evaluation_total


def run_work(spec: RunSpec) -> RunWork:
    """A run's total work from its spec (Python integers: no overflow). Prompts are those an
    evaluation can have: the run's held-out split has task.eval_size rows, a generated set
    its size; a file's rows are not known here, so its set counts eval.sets.prompts."""
    tokens = spec.rollout.max_tokens
    steps, every = spec.stop.max_steps, spec.eval.every_steps
    evaluations = 2 + ((steps - 1) // every if every else 0)
    held_out = spec.task.eval_size

    def set_prompts(one: EvalSetSpec) -> int:
        if one.dataset is None:
            return min(one.prompts, held_out)
        return min(one.prompts, one.size) if one.dataset.startswith("gen:") else one.prompts

    return RunWork(
        training=steps * spec.schedule.batch_prompts * spec.algorithm.group_size * tokens,
        evaluations=evaluations,
        greedy=min(spec.eval.prompts, held_out) * (1 + spec.eval.samples) * tokens,
        sets=tuple(set_prompts(one) * one.n * tokens for one in spec.eval.sets))
