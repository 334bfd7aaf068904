"""Reward service: scores each finished sample as soon as it arrives.

Built-in rewards are trusted code and run in a thread; user code runs in a
``RewardSandbox`` child process with a timeout and memory limit. A reward that raises,
loops or dies marks its sample (``error``) and scores 0; it never crashes the run. A
function that fails on every one of the first ``fail_fast_after`` samples is a broken
function, and the run stops with its error instead of training on zeros.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Optional

from .rewards import BUILTIN_REWARDS
from .sandbox import RewardSandbox
from .spec import RewardSpec


class RewardFunctionBroken(RuntimeError):
    pass


@dataclass
class Score:
    reward: float
    error: Optional[str] = None


class RewardService:
    def __init__(self, spec: RewardSpec, fail_fast_after: int = 16):
        self.spec = spec
        self.fail_fast_after = fail_fast_after
        self.scored = 0
        self.errors = 0
        self.last_error: Optional[str] = None
        self._lock = threading.Lock()
        self._sandbox: Optional[RewardSandbox] = None
        if spec.function == "user":
            self._sandbox = RewardSandbox(spec.code or "", timeout_s=spec.timeout_s, memory_mb=spec.memory_mb)
            self._sandbox.start()  # raises RewardCodeError for code that cannot even load
        elif spec.function not in BUILTIN_REWARDS:
            raise ValueError(f"reward.function {spec.function!r} is not a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) or 'user'")

    def score_sync(self, prompt: str, completion: str, fields: dict) -> Score:
        if self._sandbox is not None:
            with self._lock:  # one child process, one request at a time
                result = self._sandbox.score(prompt, completion, fields)
            score = Score(result.reward if result.error is None else 0.0, result.error)
        else:
            try:
                score = Score(float(BUILTIN_REWARDS[self.spec.function](prompt, completion, **fields)))
            except Exception as exc:  # a built-in on a malformed row
                score = Score(0.0, f"{type(exc).__name__}: {exc}")
        with self._lock:
            self.scored += 1
            if score.error:
                self.errors += 1
                self.last_error = score.error
            if self.errors == self.scored == self.fail_fast_after:
                raise RewardFunctionBroken(f"the reward function failed on all of the first {self.scored} samples; last error: {score.error}")
        return score

    async def score(self, prompt: str, completion: str, fields: dict) -> Score:
        return await asyncio.to_thread(self.score_sync, prompt, completion, fields)

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
