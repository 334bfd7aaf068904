"""What a rollout engine (workers/rollout/engine.py) hands out and takes: a ``Completion`` with
its per-token version track, the sampling options of every request, an update's timing, and
the errors an engine call fails with; plus the helpers that build a completion's track and
log-probs from vLLM's outputs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from workers.rollout.staleness import VersionTrack

if TYPE_CHECKING:
    from workers.agents.api import EpisodeRecord


def extend_track(track: VersionTrack, spans, produced: int, fallback_version: int,
                 policy_version: Callable[[int], int] = int, seen: Optional[VersionTrack] = None) -> None:
    """Append one request's engine-reported version spans to a sequence's track.

    ``produced`` is the sequence's total generated tokens so far (earlier requests of
    an interrupted sequence included); tokens a request reported no span for (an
    aborted request) get the last reported version, or ``fallback_version``.
    ``policy_version``: the policy version an engine label stands for (a shared engine
    labels its weight updates with its own counter: workers/rollout/pool.py).
    ``seen``: the request's tokens labelled client-side, by the version held when each
    output arrived, used where vLLM labels none (0.26: no ``weight_versions``).
    """
    for version, n in seen.runs if seen is not None else []:
        track.add(version, n)
    for span in spans or []:
        track.add(policy_version(int(span.version)), span.end - span.start)
    if track.tokens < produced:
        track.add(policy_version(int(spans[-1].version)) if spans else fallback_version, produced - track.tokens)


def delta_logprobs(c) -> list[float]:
    """The behaviour log-probs of a DELTA output's new tokens. vLLM 0.26 gives an aborted
    request's last output (no new tokens) all its log-probs so far (``logprobs[-0:]``;
    0.32 gives none): only the last ``len(token_ids)`` are the new tokens'."""
    lps = c.logprobs or []
    return [next(iter(d.values())).logprob for d in lps[len(lps) - len(c.token_ids):]]


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each generated token
    versions: VersionTrack
    finish_reason: str
    start_version: int
    started_at: float
    finished_at: float
    resubmits: int = 0  # interrupt mode: times this request was aborted and resumed
    engine: int = 0
    # task.environment: the episode's turns (token_ids then hold every id after the prompt,
    # generated and observed; workers/agents/episode.py); None for a single-turn sample
    episode: Optional["EpisodeRecord"] = None

    @property
    def length(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SamplingOptions:
    """What every request samples with besides its temperature and budget."""
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()  # stop strings (kept in the output)
    stop_token_ids: tuple[int, ...] = ()  # the model's end-of-sequence ids


@dataclass
class UpdateTiming:
    version: int
    sync_ms: float  # from the call to the engine's acknowledgement
    load_ms: float  # time the engine spent loading (generation cannot run meanwhile)
    gen_stall_ms: Optional[float] = None  # measured on the token stream, filled in later
    stall_samples: list[float] = field(default_factory=list)


class EngineDied(RuntimeError):
    """The engine's core process died while a call to it was pending."""


class EngineRPCTimeout(RuntimeError):
    """The engine did not answer a call in time (wedged)."""
