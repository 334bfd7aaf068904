"""The built-in environments, and ``make_environment``, which the rollout makes one fresh
environment per episode with.

- ``tools``: the policy may call the tools of task.environment.tools (calculator, python)
  in the model's tool-call format (workers/agents/tools.py). A turn with calls is answered by
  one ``tool`` message holding every call's result, errors included as text the model can
  read; a turn without a call is the final answer and ends the episode (the reward section
  scores it).
- ``guess_number``: the row holds a secret (``answer``, with ``low`` and ``high``); each turn's
  last integer is a guess, answered "higher", "lower" or "correct" as a ``user`` message.
  The turn that guesses it earns reward 1.0 and ends the episode. Using the feedback (a
  binary search) finds any secret of 1..100 within 7 turns; a first guess alone, rarely.
- ``user`` (or a platform environment resolved to its code): the team's code, run only in
  the OS sandbox (workers/agents/sandboxed.py).
"""
from __future__ import annotations

import asyncio
import re
from typing import Any, Optional, Sequence

from workers.agents.api import Environment, Observation, StepResult, ToolCall
from workers.agents.tools import MAX_CALLS_PER_TURN, TOOLS, Limits, parse_tool_calls, run_tool_call, tool_call_format
from workers.spec import EnvironmentSpec


class ToolsEnvironment:
    """Answers tool calls until a turn has none (the final answer)."""

    def __init__(self, spec: EnvironmentSpec, fmt: str, max_calls: int = MAX_CALLS_PER_TURN):
        self.tools = {name: TOOLS[name] for name in spec.tools}
        self.fmt, self.max_calls = fmt, max_calls
        self.limits = Limits(spec.timeout_s, spec.memory_mb, spec.output_chars)

    async def reset(self, row: dict[str, Any]) -> None:
        return None

    async def step(self, text: str, token_ids: Sequence[int]) -> StepResult:
        calls = parse_tool_calls(text, self.tools, self.fmt)
        if not calls:
            return StepResult(done=True)
        for k in range(self.max_calls, len(calls)):
            calls[k] = ToolCall(calls[k].name, calls[k].arguments,
                                error=f"at most {self.max_calls} tool calls a turn; this one was not run")
        # At once: a turn takes about one call's deadline however many calls it makes.
        records = await asyncio.gather(*(run_tool_call(call, self.tools, self.limits) for call in calls))
        if len(records) == 1:
            content = records[0].output
        else:
            content = "\n".join(f"[{k}] {r.name or 'tool call'}: {r.output}" for k, r in enumerate(records, 1))
        return StepResult(observation=Observation(content, "tool"), tools=tuple(records))

    async def close(self) -> None:
        return None


_INTEGER = re.compile(r"-?\d+")


class GuessNumberEnvironment:
    """Guess the row's secret integer with higher/lower feedback."""

    def __init__(self, reward: float = 1.0):
        self.reward = float(reward)
        self.secret, self.low, self.high = 0, 1, 100

    async def reset(self, row: dict[str, Any]) -> None:
        self.secret = int(str(row["answer"]).strip())
        self.low, self.high = int(row.get("low", 1)), int(row.get("high", 100))

    async def step(self, text: str, token_ids: Sequence[int]) -> StepResult:
        found = _INTEGER.findall(text)
        if not found:
            return StepResult(Observation(f"Please answer with one whole number from {self.low} to {self.high}.",
                                          "user"))
        guess = int(found[-1])
        if guess == self.secret:
            return StepResult(Observation(f"{guess} is correct.", "user"), reward=self.reward, done=True)
        hint = "higher" if guess < self.secret else "lower"
        return StepResult(Observation(f"{guess} is wrong: the number is {hint} than {guess}.", "user"))

    async def close(self) -> None:
        return None


BUILTIN_ENVIRONMENTS = ("tools", "guess_number")


def make_environment(spec: EnvironmentSpec, *, model_path: str) -> Environment:
    """A fresh environment for one episode: a built-in one by ``spec.name``, or, for
    ``user`` (or a platform environment resolved to its code), the sandboxed one."""
    kwargs: dict[str, Any] = dict(spec.params)
    env: Optional[Environment] = None
    try:
        if spec.name == "tools":
            env = ToolsEnvironment(spec, tool_call_format(model_path), **kwargs)
        elif spec.name == "guess_number":
            env = GuessNumberEnvironment(**kwargs)
    except TypeError as exc:
        raise ValueError(f"task.environment.params for {spec.name!r}: {exc}") from None
    if env is not None:
        return env
    if spec.code:
        from workers.agents.sandboxed import make_sandboxed_environment

        return make_sandboxed_environment(spec)
    if "@" in spec.name:
        raise ValueError(f"the environment {spec.name!r} is a platform environment: resolve it to its code first")
    raise ValueError(f"unknown environment {spec.name!r}; the built-in ones are {', '.join(BUILTIN_ENVIRONMENTS)}, "
                     "or 'user' with code")
