"""The typed contract of agentic RL: what an environment is, what one step of it returns,
and what an episode records for the trainer and the dashboard.

An episode is token-in/token-out. The policy generates a turn (token ids, each with its
behaviour log-prob and the policy version that produced it); the environment answers with
an ``Observation`` message; the observation is rendered once by the model's chat template
and its ids appended. Nothing generated is ever decoded and tokenised again, so the ids
the trainer trains on are exactly the ids the engine produced.

Environments (built-in: workers/agents/builtin.py; a team's own: workers/agents/sandboxed.py,
run only inside the OS sandbox) implement ``Environment``. Every method is async: a
sandboxed environment or a tool waits on another process.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Protocol, Sequence, runtime_checkable

# Why an episode ended (Sample.episode.end_reason; the share of each is a metric,
# agent/end/<reason>).
END_REASONS = (
    "done",                # the environment ended it (an answer, a solved task)
    "max_turns",           # task.environment.max_turns turns generated
    "max_episode_tokens",  # the episode's token budget ran out
    "max_model_len",       # prompt + episode reached the engine's context
    "environment_error",   # the environment raised, hung, flooded or died: named in end_detail
)
EndReason = Literal["done", "max_turns", "max_episode_tokens", "max_model_len", "environment_error"]


@dataclass(frozen=True)
class Observation:
    """What the environment says back: one chat message, rendered by the model's chat
    template (``tool`` for a tool's output, ``user`` for feedback or a new request)."""
    content: str
    role: Literal["tool", "user"] = "tool"


@dataclass(frozen=True)
class ToolCall:
    """A tool call parsed from a generated turn (workers/agents/tools.py). ``error`` is set
    when the call is malformed (bad JSON, unknown tool, wrong arguments): the environment
    answers with an error observation instead of running anything."""
    name: str
    arguments: dict[str, Any]
    error: Optional[str] = None


@dataclass(frozen=True)
class ToolRecord:
    """One tool call an environment made in a step, for the sample browser and the metrics."""
    name: str
    arguments: dict[str, Any]
    output: str
    error: Optional[str] = None  # "timeout", "output_limit", "memory", a raised exception, a malformed call
    ms: float = 0.0


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to one generated turn.

    ``observation`` is appended (masked out of the loss) and the policy generates again,
    unless ``done``. ``reward`` is this turn's reward (task.environment.rewards says how
    turn rewards and the reward section's final score combine). ``end_detail`` says why
    an episode ended early (e.g. "tool python: killed after 5 s")."""
    observation: Optional[Observation] = None
    reward: float = 0.0
    done: bool = False
    tools: tuple[ToolRecord, ...] = ()
    error: Optional[str] = None  # the environment itself failed: the episode ends, reason environment_error


@runtime_checkable
class Environment(Protocol):
    """One episode's environment. ``reset`` once with the dataset row (its prompt and every
    other field, e.g. the answer), then ``step`` once per generated turn, then ``close``."""

    async def reset(self, row: dict[str, Any]) -> None: ...

    async def step(self, text: str, token_ids: Sequence[int]) -> StepResult: ...

    async def close(self) -> None: ...


@dataclass
class Turn:
    """One turn of an episode, as offsets into the episode's token ids (the ids after the
    prompt): the generated span ``[start, start + generated)`` is trained on; the observation
    span that follows, ``[start + generated, start + generated + observed)``, is masked."""
    start: int
    generated: int
    observed: int = 0
    reward: float = 0.0
    text: str = ""  # the generated turn, decoded for the environment and the browser
    observation: Optional[Observation] = None
    tools: list[ToolRecord] = field(default_factory=list)
    finish_reason: str = ""  # the engine's: stop, length, ...
    # the ids the engine returned for this turn, kept as they came (the token-exactness check
    # compares the trainer's packed ids with these)
    engine_ids: list[int] = field(default_factory=list, repr=False)


@dataclass
class EpisodeRecord:
    """What an episode was, beside the Completion's concatenated ids, log-probs and versions."""
    turns: list[Turn]
    end_reason: EndReason
    end_detail: str = ""

    @property
    def tool_calls(self) -> int:
        return sum(len(t.tools) for t in self.turns)

    @property
    def tool_errors(self) -> int:
        return sum(1 for t in self.turns for r in t.tools if r.error)

    def loss_mask(self) -> list[int]:
        """1 on each generated token, 0 on each observation token, in episode order."""
        mask: list[int] = []
        for turn in self.turns:
            mask += [1] * turn.generated + [0] * turn.observed
        return mask
