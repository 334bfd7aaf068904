"""The turn loop: one episode of a policy and an environment, token-in/token-out.

Each turn generates from the prompt and the episode's ids so far; the turn's ids, their
behaviour log-probs and their policy versions are appended exactly as the engine gave
them. The environment sees the turn's text (decoded for it and for the browser only) and
its ids, and answers with an observation, rendered once by the chat template
(workers/agents/render.py) and appended with log-prob 0.0 and the version of the token
before it; observation ids are masked out of the loss. The loop ends when the environment
says done, a budget runs out (max_turns, max_episode_tokens, max_model_len) or the
environment fails (it raised, hung past its deadline, or reported an error): then the
episode ends with ``environment_error`` and the run goes on.

Episodes under in-flight weight updates keep each token's own version and log-prob: a
turn generated across an update carries both versions (the engine labels each token), and
earlier turns keep theirs.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Sequence

from workers.agents.api import EndReason, Environment, EpisodeRecord, StepResult, Turn
from workers.agents.render import ObservationRenderer
from workers.rollout.engine_types import Completion
from workers.rollout.staleness import VersionTrack

logger = logging.getLogger(__name__)

# (ids, max_tokens) -> the finished Completion of one turn (the fleet's: engine.generate,
# then finish_elsewhere for a request handed off or whose engine died)
GenerateFn = Callable[[list[int], int], Awaitable[Completion]]


@dataclass(frozen=True)
class Budgets:
    """What bounds an episode (task.environment, with rollout.max_tokens as the default
    turn budget and the engine's context)."""
    max_turns: int
    max_turn_tokens: int
    max_episode_tokens: int
    max_observation_tokens: int
    max_model_len: int
    timeout_s: float

    @classmethod
    def of(cls, env_spec, max_tokens: int, max_model_len: int) -> "Budgets":
        return cls(env_spec.max_turns, env_spec.max_turn_tokens or max_tokens, env_spec.max_episode_tokens,
                   env_spec.max_observation_tokens, max_model_len, env_spec.timeout_s)

    @property
    def call_deadline_s(self) -> float:
        """How long one reset or step may take before the episode ends: the environment's own
        limit (``timeout_s``, which its tools enforce and answer with an error observation)
        plus a grace, so that only an environment hung itself is cut off here."""
        return self.timeout_s * 1.5 + 2.0


class EnvironmentFailed(RuntimeError):
    """The environment raised, hung or reported an error: the episode ends (environment_error)."""


async def _call(what: str, aw: Awaitable, deadline_s: float):
    try:
        return await asyncio.wait_for(aw, deadline_s)
    except asyncio.TimeoutError:
        raise EnvironmentFailed(f"{what}: no answer within {deadline_s:g} s") from None
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the environment raised ends only its episode
        raise EnvironmentFailed(f"{what} raised {type(exc).__name__}: {exc}"[:500]) from exc


async def run_episode(generate: GenerateFn, env: Environment, row: dict[str, Any], prompt_ids: list[int],
                      budgets: Budgets, renderer: ObservationRenderer, chat: bool) -> Completion:
    """One episode as a ``Completion``: ``token_ids`` every id after the prompt (turns and
    observations in order), ``logprobs`` the behaviour log-prob of each (0.0 on observation
    ids), ``versions`` over every id, and ``episode`` its turns and why it ended. ``chat``:
    the prompt is a chat conversation (observations are chat messages), else raw text.
    The environment is always closed."""
    ids: list[int] = []
    logprobs: list[float] = []
    track = VersionTrack()
    turns: list[Turn] = []
    end: Optional[EndReason] = None
    detail = ""
    first: Optional[Completion] = None
    last: Optional[Completion] = None
    resubmits = 0
    started = time.time()
    try:
        try:
            await _call("reset", env.reset(row), budgets.call_deadline_s)
        except EnvironmentFailed as exc:
            end, detail = "environment_error", str(exc)
        while end is None:
            context = len(prompt_ids) + len(ids)
            room = min(budgets.max_turn_tokens, budgets.max_episode_tokens - len(ids),
                       budgets.max_model_len - context)
            if room <= 0:
                end = "max_episode_tokens" if budgets.max_episode_tokens - len(ids) <= 0 else "max_model_len"
                break
            comp = await generate(prompt_ids + ids, room)
            first, last = first or comp, comp
            resubmits += comp.resubmits
            turn = Turn(start=len(ids), generated=comp.length, finish_reason=comp.finish_reason,
                        engine_ids=list(comp.token_ids))
            turns.append(turn)
            ids += comp.token_ids
            logprobs += comp.logprobs
            for version, n in comp.versions.runs:
                track.add(version, n)
            turn.text = renderer.decode(comp.token_ids)
            try:
                result: StepResult = await _call("step", env.step(turn.text, list(comp.token_ids)),
                                                 budgets.call_deadline_s)
                if result.error:
                    raise EnvironmentFailed(result.error)
            except EnvironmentFailed as exc:
                end, detail = "environment_error", str(exc)
                break
            turn.reward = float(result.reward)
            turn.tools = list(result.tools)
            if result.done:
                end = "done"
                break
            if len(turns) >= budgets.max_turns:
                end = "max_turns"
                break
            if result.observation is None:
                continue  # the policy goes on from its own turn
            obs_ids, shown = renderer.ids(result.observation, chat, comp.token_ids, budgets.max_observation_tokens)
            turn.observation = shown
            # the observation must leave room for at least one generated token
            if len(ids) + len(obs_ids) >= budgets.max_episode_tokens:
                end = "max_episode_tokens"
                break
            if len(prompt_ids) + len(ids) + len(obs_ids) >= budgets.max_model_len:
                end = "max_model_len"
                break
            turn.observed = len(obs_ids)
            ids += obs_ids
            logprobs += [0.0] * len(obs_ids)
            # masked anyway: an observation id carries the version of the token before it
            track.add(track.runs[-1][0] if track.runs else (comp.start_version), len(obs_ids))
    finally:
        try:
            await _call("close", env.close(), budgets.call_deadline_s)
        except EnvironmentFailed as exc:
            logger.warning("an environment did not close cleanly: %s", exc)
    if end == "environment_error":
        logger.info("an episode ended with environment_error: %s", detail)
    record = EpisodeRecord(turns, end or "done", detail)
    if last is None:  # the environment failed before any turn
        return Completion(list(prompt_ids), [], [], track, "environment_error", 0, started, time.time(),
                          episode=record)
    return Completion(list(prompt_ids), ids, logprobs, track, last.finish_reason, first.start_version, started,
                      time.time(), resubmits, last.engine, episode=record)


# -- what the trainer and the metrics read off an episode ------------------------------------
def loss_mask(comp: Completion) -> Optional[list[int]]:
    """The Completion's loss mask (1 on generated ids, 0 on observation ids); None for a
    single-turn sample (every id trained)."""
    return comp.episode.loss_mask() if comp.episode is not None else None


def engine_ids(comp: Completion) -> list[int]:
    """The ids the engine generated, as it returned them turn by turn (recorded when each
    turn finished): what the trainer must train on, in order."""
    if comp.episode is None:
        return list(comp.token_ids)
    return [i for t in comp.episode.turns for i in t.engine_ids]


def oldest_trained_version(comp: Completion, fallback: int) -> int:
    """The policy version of the oldest trained (generated) token; ``fallback`` when none."""
    versions = comp.versions.per_token()
    mask = loss_mask(comp)
    trained = [v for k, v in enumerate(versions) if mask is None or (k < len(mask) and mask[k])]
    return min(trained, default=fallback)


def trained_versions(comp: Completion) -> list[int]:
    """The versions of the generated tokens only (an episode's observations left out)."""
    versions = comp.versions.per_token()
    mask = loss_mask(comp)
    return versions if mask is None else [v for v, m in zip(versions, mask) if m]


def token_rewards(record: EpisodeRecord, final: float, mode: str) -> list[float]:
    """Per id of the episode, the reward GAE credits: with ``rewards`` turns|both each
    turn's environment reward on that turn's last generated token; with final|both the
    reward section's score on the episode's last generated token; 0 elsewhere (observation
    ids included)."""
    out = [0.0] * sum(t.generated + t.observed for t in record.turns)
    generated = [t for t in record.turns if t.generated]
    if mode in ("turns", "both"):
        for t in generated:
            out[t.start + t.generated - 1] += t.reward
    if mode in ("final", "both") and generated:
        t = generated[-1]
        out[t.start + t.generated - 1] += final
    return out


def episode_reward(record: EpisodeRecord, final: float, mode: str) -> float:
    """The episode's scalar reward (group advantages use it): ``token_rewards`` summed."""
    turns = sum(t.reward for t in record.turns)
    return {"final": final, "turns": turns, "both": final + turns}[mode]


def last_turn_text(record: EpisodeRecord) -> str:
    """What ``rewards: final`` scores: the episode's last generated turn."""
    generated = [t for t in record.turns if t.generated]
    return generated[-1].text if generated else ""


def versions_of_turn(comp: Completion, turn: Turn) -> list[list[int]]:
    """[[version, count], ...] over a turn's generated tokens, in order."""
    out: list[list[int]] = []
    for v in comp.versions.per_token()[turn.start: turn.start + turn.generated]:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def episode_view(comp: Completion) -> dict:
    """The sample record's ``episode`` key (the sample browser's turn-by-turn view)."""
    record = comp.episode
    return {"end_reason": record.end_reason, "end_detail": record.end_detail, "turns": [
        {"text": t.text, "generated": t.generated, "observed": t.observed, "versions": versions_of_turn(comp, t),
         "observation": ({"role": t.observation.role, "content": t.observation.content}
                         if t.observation is not None else None),
         "tools": [{"name": r.name, "arguments": r.arguments, "output": r.output, "error": r.error, "ms": r.ms}
                   for r in t.tools],
         "reward": t.reward} for t in record.turns]}


def agent_metrics(comps: Sequence[Completion]) -> dict[str, float]:
    """The step's agent/* metrics over its episodes (none without episodes); agent/token_exact
    is the trainer's check (workers/train/batching.py ``trained_ids``), added by the caller."""
    from workers.agents.api import END_REASONS

    episodes = [c for c in comps if c.episode is not None]
    if not episodes:
        return {}
    n = len(episodes)
    tools = [r for c in episodes for t in c.episode.turns for r in t.tools]
    out = {
        "agent/turns": sum(len(c.episode.turns) for c in episodes) / n,
        "agent/tool_calls": sum(c.episode.tool_calls for c in episodes) / n,
        "agent/tool_errors": sum(c.episode.tool_errors for c in episodes) / n,
        "agent/tool_ms": sum(r.ms for r in tools) / len(tools) if tools else 0.0,
        "agent/observation_tokens": sum(t.observed for c in episodes for t in c.episode.turns) / n,
        "agent/versions_per_episode": sum(len(set(trained_versions(c))) for c in episodes) / n,
    }
    for reason in END_REASONS:
        out[f"agent/end/{reason}"] = sum(1 for c in episodes if c.episode.end_reason == reason) / n
    return out
