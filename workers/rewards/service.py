"""Reward service: scores each finished sample as soon as it arrives.

Built-in rewards are trusted code and run in a thread; user code runs in a
``RewardSandbox`` child process with a timeout and memory limit. A reward that raises,
loops or dies marks its sample (``error``) and scores 0; it never crashes the run. A
function that fails on every one of the first ``fail_fast_after`` samples is a broken
function, and the run stops with its error instead of training on zeros.

A neural reward model (``reward.model``, used by ``function: model`` or a component
``{function: model}``) runs in a worker of its own (workers/rewards/model.py); samples
that finish close together share its micro-batches. A model that fails stops the run
with its error: unlike a rule on one malformed row, it would fail every sample after.

With ``reward.components`` the reward is the weighted sum of the components; a component
that fails scores 0 and marks the sample's error (named after the component), the others
still count. ``Score.parts`` holds each component's own (unweighted) reward, and
``part_means()`` their running means, for ``reward/<name>`` metrics.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

from workers.tasks.builtin_rewards import BUILTIN_REWARDS
from workers.rewards.model import RewardModelClient, RewardModelError
from workers.rewards.sandbox import RewardSandbox
from workers.spec import RewardSpec


class RewardFunctionBroken(RuntimeError):
    pass


MODEL = object()  # a component's function: the reward model's score, computed before the sum


@dataclass
class Score:
    reward: float
    error: Optional[str] = None
    # reward.components only: each component's own reward (before its weight), by name
    parts: dict[str, float] = field(default_factory=dict)


@dataclass
class _Component:
    name: str
    weight: float
    function: Optional[Callable[..., float]] | object  # None: the user code, in the sandbox; MODEL
    params: dict


class RewardService:
    def __init__(self, spec: RewardSpec, fail_fast_after: int = 16, model_placement=None,
                 model_max_tokens: int = 1 << 22):
        """``model_placement``: the reward model's process in a GPU plan (role "inference"),
        None to run it on the CPU; ``model_max_tokens``: padded tokens per forward of it."""
        self.spec = spec
        self.fail_fast_after = fail_fast_after
        self.scored = 0
        self.errors = 0
        self.last_error: Optional[str] = None
        self._lock = threading.Lock()
        self._sandbox: Optional[RewardSandbox] = None
        self.model: Optional[RewardModelClient] = None
        self.components: list[_Component] = []
        self._part_sums: dict[str, float] = {}
        if spec.components:
            for c in spec.components:
                if c.function not in ("user", "model") and c.function not in BUILTIN_REWARDS:
                    raise ValueError(f"reward component {c.function!r} is not a built-in, 'user' or 'model'")
                function = MODEL if c.function == "model" else BUILTIN_REWARDS.get(c.function)
                self.components.append(_Component(c.name or c.function, c.weight, function, dict(c.params)))
            self._part_sums = {c.name: 0.0 for c in self.components}
            uses_code = any(c.function is None for c in self.components)
        elif spec.function not in BUILTIN_REWARDS and spec.function not in ("user", "model"):
            raise ValueError(f"reward.function {spec.function!r} is not a built-in ({', '.join(sorted(BUILTIN_REWARDS))}), "
                             "'user' or 'model'")
        else:
            uses_code = spec.function == "user"
        if spec.model is not None:
            self.model = RewardModelClient(spec.model, model_placement, model_max_tokens)
            self.model.start()  # raises RewardModelError for a folder that cannot be loaded
        if uses_code:
            self._sandbox = RewardSandbox(spec.code or "", timeout_s=spec.timeout_s, memory_mb=spec.memory_mb)
            self._sandbox.start()  # raises RewardCodeError for code that cannot even load

    def _one(self, function: Optional[Callable[..., float]], prompt: str, completion: str, fields: dict) -> Score:
        """One function's score: a built-in in this thread, or the user code in the sandbox."""
        if function is None:
            with self._lock:  # one child process, one request at a time
                result = self._sandbox.score(prompt, completion, fields)
            return Score(result.reward if result.error is None else 0.0, result.error)
        try:
            return Score(float(function(prompt, completion, **fields)))
        except Exception as exc:  # a built-in on a malformed row
            return Score(0.0, f"{type(exc).__name__}: {exc}")

    def _sum(self, prompt: str, completion: str, fields: dict, model: Optional[float] = None) -> Score:
        total, parts, errors = 0.0, {}, []
        for c in self.components:
            if c.function is MODEL:
                part = Score(model)
            else:
                part = self._one(c.function, prompt, completion, {**fields, **c.params})  # params win over row fields
            if part.error:
                errors.append(f"{c.name}: {part.error}")
            parts[c.name] = part.reward
            total += c.weight * part.reward
        return Score(total, "; ".join(errors) or None, parts)

    def score_sync(self, prompt: str, completion: str, fields: dict, model: Optional[float] = None) -> Score:
        """The sample's score; ``model`` is the reward model's score of it (``score()``
        gets it from the model's micro-batches before the rule components run; called
        without it, the model scores this one text now)."""
        if self.model is not None and model is None:
            try:
                model = self.model.reward(self.model.forward([prompt + completion])[0])
            except RewardModelError as exc:
                raise RewardFunctionBroken(f"reward.model: {exc}") from None
        if self.components:
            score = self._sum(prompt, completion, fields, model)
        elif self.spec.function == "model":
            score = Score(model)
        else:
            builtin = None if self._sandbox is not None else BUILTIN_REWARDS[self.spec.function]
            score = self._one(builtin, prompt, completion, fields)
        with self._lock:
            for name, value in score.parts.items():
                self._part_sums[name] += value
            self.scored += 1
            if score.error:
                self.errors += 1
                self.last_error = score.error
            if self.errors == self.scored == self.fail_fast_after:
                raise RewardFunctionBroken(f"the reward function failed on all of the first {self.scored} samples; last error: {score.error}")
        return score

    def part_means(self) -> dict[str, float]:
        """reward.components only: each component's mean (unweighted) reward over every
        sample scored so far, by name; {} for a single function."""
        with self._lock:
            return {name: total / self.scored for name, total in self._part_sums.items()} if self.scored else {}

    async def score(self, prompt: str, completion: str, fields: dict) -> Score:
        model = None
        if self.model is not None:
            try:
                model = await self.model.score(prompt + completion)
            except RewardModelError as exc:
                raise RewardFunctionBroken(f"reward.model: {exc}") from None
        return await asyncio.to_thread(self.score_sync, prompt, completion, fields, model)

    def model_stats(self) -> dict[str, float]:
        """The reward model's work so far: forwards, texts and seconds waited on them."""
        return self.model.stats() if self.model is not None else {}

    def close(self) -> None:
        if self.model is not None:
            self.model.close()
        if self._sandbox is not None:
            self._sandbox.close()
