"""The ``eval`` section: held-out evaluation, greedy and sampled, and named evaluation sets."""
from __future__ import annotations

from typing import Optional

from pydantic import Field, field_validator, model_validator

from workers.spec.base import MAX_RUN_MINUTES, _Strict
from workers.spec.reward import RewardSpec

# eval/<set>/... beside these: a set may not be named like them (docs/architecture.md §5)
RESERVED_EVAL_SET_NAMES = ("accuracy", "sampled_reward", "part")


class EvalSetSpec(_Strict):
    """One held-out evaluation set (``eval.sets``): n completions per prompt sampled at a
    temperature, scored by the set's reward, reported as ``eval/<name>/pass@<k>`` (the
    unbiased estimator, Chen et al. 2021) and ``eval/<name>/avg@<n>`` (mean reward)."""
    name: str = Field(min_length=1, max_length=40, pattern=r"^[A-Za-z0-9_.-]+$", description=(
        "the set's label in its metric names, eval/<name>/pass@<k>"))
    dataset: Optional[str] = Field(None, description="a JSONL file, a generator gen:<name>[?k=v&...] or, on the "
                                   "platform, a team dataset name[@version]; default: the run's own held-out split "
                                   "(task.eval_size rows)")
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    size: int = Field(200, ge=1, le=100_000, description="rows to generate for gen: datasets")
    seed: int = Field(1, description="the generator's seed (gen: datasets); another seed than task.seed gives "
                      "other rows")
    reward: Optional[RewardSpec] = Field(None, description="how the set's samples are scored (the forms of the "
                                         "run's reward section); default: the run's reward")
    prompts: int = Field(200, ge=1, le=100_000, description="held-out prompts evaluated (the set's first ones)")
    n: int = Field(4, ge=1, le=256, description="completions sampled per prompt")
    k: list[int] = Field(default_factory=list, validate_default=True, description="pass@k reported for each k "
                         "(1 <= k <= n); default: 1 and n")
    temperature: Optional[float] = Field(None, ge=0, le=10, description="sampling temperature; default: "
                                         "rollout.temperature; 0 (greedy) needs n 1")
    pass_reward: float = Field(1.0, allow_inf_nan=False, description="a sample passes (counts as correct for "
                               "pass@k) when its reward is at least this")

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        if name in RESERVED_EVAL_SET_NAMES:
            raise ValueError(f"{name!r} is taken by eval/{name} metrics; choose another name")
        return name

    @field_validator("dataset")
    @classmethod
    def _set_generator_bounded(cls, value):
        if value is not None and value.startswith("gen:"):
            from workers.tasks.datasets import parse_generator

            parse_generator(value)
        return value

    @field_validator("k", mode="before")
    @classmethod
    def _one_k_is_a_list(cls, value):
        return [value] if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("k")
    @classmethod
    def _k_within_n(cls, ks: list[int], info) -> list[int]:
        n = info.data.get("n")
        if not ks and n is not None:
            return sorted({1, n})
        bad = [k for k in ks if k < 1 or (n is not None and k > n)]
        if bad:
            raise ValueError(f"pass@k needs 1 <= k <= n ({n} samples per prompt); not {', '.join(map(str, bad))}")
        if len(set(ks)) != len(ks):
            raise ValueError("each k once")
        return sorted(ks)

    @field_validator("temperature")
    @classmethod
    def _greedy_is_one_sample(cls, temperature, info):
        if temperature == 0 and (info.data.get("n") or 1) > 1:
            raise ValueError(f"temperature 0 (greedy) gives n ({info.data['n']}) identical samples: set n 1, or a "
                             "temperature above 0")
        return temperature

    @field_validator("reward")
    @classmethod
    def _rule_rewards(cls, reward):
        if reward is not None and reward.model is not None:
            raise ValueError("a reward model (reward.model) is not supported in an evaluation set: leave the set's "
                             "reward out to score with the run's reward")
        return reward

    @model_validator(mode="after")
    def _generated_set_bounded(self):
        if self.dataset is not None and self.dataset.startswith("gen:"):
            from workers.tasks.datasets import parse_generator

            parse_generator(self.dataset, self.size)
        return self


class EvalSpec(_Strict):
    every_steps: int = Field(20, ge=0, description="0 = only before and after")
    prompts: int = Field(200, ge=0)
    timeout_minutes: float = Field(60.0, gt=0, le=MAX_RUN_MINUTES, description="each evaluation's time at most, "
                                   "the one before step 0 too: one that runs past it is stopped, reported as "
                                   "eval/timed_out 1 with no other eval metrics for that step, and the run goes on")
    samples: int = Field(0, ge=0, le=64, description="also sample this many completions per held-out prompt at "
                         "rollout.temperature: their mean reward is eval/sampled_reward (0 = greedy only)")
    sets: list[EvalSetSpec] = Field(default_factory=list, max_length=16, description=(
        "held-out sets evaluated with n samples per prompt (pass@k, avg@n), each with its own data and reward, "
        "at every evaluation beside eval/accuracy"))

    @field_validator("sets")
    @classmethod
    def _distinct_names(cls, sets: list[EvalSetSpec]) -> list[EvalSetSpec]:
        seen: dict[str, int] = {}
        for i, one in enumerate(sets):
            if one.name in seen:
                raise ValueError(f"sets {seen[one.name]} and {i} are both named {one.name!r}")
            seen[one.name] = i
        return sets
