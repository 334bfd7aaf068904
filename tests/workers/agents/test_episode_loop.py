"""The turn loop's bookkeeping with a scripted policy (the engine's part is tested in
test_episode_engine.py): ids, log-probs and versions appended as generated, observations
masked, each budget ending an episode with its reason, a failing environment ending only
its own episode, rewards per turn and staleness by the oldest trained token."""
import asyncio
import time
from types import SimpleNamespace

import pytest

from workers.agents.api import Observation, StepResult, ToolRecord
from workers.agents.episode import (Budgets, agent_metrics, episode_reward, episode_view, oldest_trained_version,
                                    run_episode, token_rewards, trained_versions)
from workers.agents.render import ObservationRenderer
from workers.coord.async_schedule import AsyncSchedule, group_oldest_version
from workers.coord.generation import Group, Sample
from workers.rollout.engine_types import Completion
from workers.rollout.staleness import VersionTrack
from workers.tasks.prompts import load_tokenizer


class ScriptedPolicy:
    """Turns of ``length`` tokens (fewer if the budget says so), log-prob -0.5 each, version
    ``versions[k]`` for turn k; records each call's context length and budget."""

    def __init__(self, length=4, versions=(0, 1, 2, 3, 4, 5, 6, 7)):
        self.length, self.versions, self.calls = length, versions, []

    async def __call__(self, ids, max_tokens):
        k = len(self.calls)
        self.calls.append((len(ids), max_tokens))
        n = min(self.length, max_tokens)
        track = VersionTrack()
        track.add(self.versions[k], n)
        tokens = [20 + (k * 7 + j) % 60 for j in range(n)]
        return Completion(list(ids), tokens, [-0.5] * n, track, "length" if n == max_tokens else "stop",
                          self.versions[k], time.time(), time.time())


class Env:
    """Answers each turn with an observation; done after ``done_after`` turns (None: never)."""

    def __init__(self, done_after=None, reward=0.25, fail_at=None, error_at=None, hang_at=None):
        self.done_after, self.reward = done_after, reward
        self.fail_at, self.error_at, self.hang_at = fail_at, error_at, hang_at
        self.steps, self.closed, self.row = 0, False, None

    async def reset(self, row):
        self.row = row

    async def step(self, text, token_ids):
        self.steps += 1
        if self.steps == self.fail_at:
            raise ZeroDivisionError("the environment divided by zero")
        if self.steps == self.hang_at:
            await asyncio.sleep(3600)
        if self.steps == self.error_at:
            return StepResult(error="tool python: killed after 5 s")
        done = self.done_after is not None and self.steps >= self.done_after
        return StepResult(Observation("ok", "tool"), self.reward, done,
                          (ToolRecord("calculator", {"expression": "1+1"}, "2", ms=3.0),))

    async def close(self):
        self.closed = True


@pytest.fixture(scope="module")
def renderer(tiny_model_path):
    return ObservationRenderer(load_tokenizer(tiny_model_path), None)


def _budgets(**kw):
    base = dict(max_turns=4, max_turn_tokens=4, max_episode_tokens=512, max_observation_tokens=16,
                max_model_len=256, timeout_s=0.2)
    return Budgets(**{**base, **kw})


def _run(policy, env, renderer, budgets, prompt=(5, 6, 7)):
    return asyncio.run(run_episode(policy, env, {"prompt": "x"}, list(prompt), budgets, renderer, chat=False))


def test_an_episode_concatenates_turns_and_masked_observations_as_generated(renderer):
    env = Env(done_after=3)
    comp = _run(ScriptedPolicy(), env, renderer, _budgets())
    ep = comp.episode
    assert ep.end_reason == "done" and env.closed and env.row == {"prompt": "x"}
    obs = renderer.encode("ok\n")  # 3 ids: 'o', 'k', the newline
    assert [(t.start, t.generated, t.observed) for t in ep.turns] == [(0, 4, 3), (7, 4, 3), (14, 4, 0)]
    assert ep.loss_mask() == [1] * 4 + [0] * 3 + [1] * 4 + [0] * 3 + [1] * 4
    assert comp.token_ids[4:7] == obs and comp.token_ids[11:14] == obs
    assert [i for t in ep.turns for i in t.engine_ids] == [i for i, m in zip(comp.token_ids, ep.loss_mask()) if m]
    assert comp.logprobs == [-0.5] * 4 + [0.0] * 3 + [-0.5] * 4 + [0.0] * 3 + [-0.5] * 4
    # an observation id carries the version of the token before it
    assert comp.versions.runs == [[0, 7], [1, 7], [2, 4]]
    assert trained_versions(comp) == [0] * 4 + [1] * 4 + [2] * 4
    assert comp.prompt_ids == [5, 6, 7] and comp.start_version == 0


def test_max_turns_ends_the_episode(renderer):
    comp = _run(ScriptedPolicy(), Env(), renderer, _budgets(max_turns=2))
    assert comp.episode.end_reason == "max_turns" and len(comp.episode.turns) == 2
    assert comp.episode.turns[-1].observed == 0  # nothing is appended after the last turn


def test_the_episode_token_budget_bounds_each_turn_and_ends_the_episode(renderer):
    policy = ScriptedPolicy()
    comp = _run(policy, Env(), renderer, _budgets(max_turns=10, max_episode_tokens=12))
    # turn 1: 4 + obs 3 = 7; turn 2 may take min(4, 12 - 7) = 4, then obs would leave no room
    assert [budget for _, budget in policy.calls] == [4, 4]
    assert comp.episode.end_reason == "max_episode_tokens"
    assert comp.length == 11


def test_the_context_ends_the_episode_at_max_model_len(renderer):
    policy = ScriptedPolicy()
    comp = _run(policy, Env(), renderer, _budgets(max_turns=10, max_model_len=3 + 7 + 2))
    assert [budget for _, budget in policy.calls] == [4, 2]  # the second turn gets what is left of the context
    assert comp.episode.end_reason == "max_model_len"
    assert comp.length == 9


@pytest.mark.parametrize("env, detail", [(Env(fail_at=2), "ZeroDivisionError"),
                                         (Env(error_at=2), "killed after 5 s"),
                                         (Env(hang_at=2), "no answer within")])
def test_an_environment_that_raises_errs_or_hangs_ends_its_episode_with_environment_error(renderer, env, detail):
    comp = _run(ScriptedPolicy(), env, renderer, _budgets())
    assert comp.episode.end_reason == "environment_error"
    assert detail in comp.episode.end_detail
    assert env.closed
    assert len(comp.episode.turns) == 2 and comp.episode.turns[-1].observed == 0


def test_other_episodes_finish_while_one_environment_hangs(renderer):
    async def both():
        return await asyncio.gather(
            run_episode(ScriptedPolicy(), Env(hang_at=1), {"prompt": "x"}, [5], _budgets(), renderer, False),
            run_episode(ScriptedPolicy(), Env(done_after=2), {"prompt": "y"}, [5], _budgets(), renderer, False))

    hung, fine = asyncio.run(both())
    assert hung.episode.end_reason == "environment_error"
    assert fine.episode.end_reason == "done" and len(fine.episode.turns) == 2


def test_turn_and_final_rewards_sit_on_each_turns_last_generated_token(renderer):
    ep = _run(ScriptedPolicy(), Env(done_after=2, reward=0.25), renderer, _budgets()).episode
    # ids: turn 0 at 0..3, observation 4..6, turn 1 at 7..10
    expect_turns = [0.0] * 3 + [0.25] + [0.0] * 6 + [0.25]
    assert token_rewards(ep, 1.0, "turns") == expect_turns
    assert token_rewards(ep, 1.0, "final") == [0.0] * 10 + [1.0]
    assert token_rewards(ep, 1.0, "both") == [0.0] * 3 + [0.25] + [0.0] * 6 + [1.25]
    assert (episode_reward(ep, 1.0, "final"), episode_reward(ep, 1.0, "turns"), episode_reward(ep, 1.0, "both")) \
        == (1.0, 0.5, 1.5)


def test_agent_metrics_and_the_episode_view(renderer):
    a = _run(ScriptedPolicy(), Env(done_after=2), renderer, _budgets())
    b = _run(ScriptedPolicy(), Env(), renderer, _budgets(max_turns=3))
    m = agent_metrics([a, b])
    assert m["agent/turns"] == 2.5 and m["agent/tool_calls"] == 2.5 and m["agent/tool_errors"] == 0.0
    assert m["agent/tool_ms"] == 3.0 and m["agent/observation_tokens"] == 4.5
    assert m["agent/end/done"] == 0.5 and m["agent/end/max_turns"] == 0.5 and m["agent/end/max_model_len"] == 0.0
    assert m["agent/versions_per_episode"] == 2.5
    view = episode_view(a)
    assert view["end_reason"] == "done"
    assert view["turns"][0]["versions"] == [[0, 4]] and view["turns"][1]["versions"] == [[1, 4]]
    assert view["turns"][0]["observation"] == {"role": "tool", "content": "ok"}
    assert view["turns"][1]["observation"] is None
    assert view["turns"][0]["tools"][0] == {"name": "calculator", "arguments": {"expression": "1+1"}, "output": "2",
                                            "error": None, "ms": 3.0}


def _episode_sample(runs, mask):
    track = VersionTrack()
    for v, n in runs:
        track.add(v, n)
    comp = Completion([1], [9] * len(mask), [0.0] * len(mask), track, "stop", runs[0][0], 0.0, 0.0)
    comp.episode = SimpleNamespace(loss_mask=lambda: mask)
    return Sample({"prompt": "x"}, comp, "", 0.0)


def test_staleness_counts_an_episode_by_its_oldest_trained_token():
    # versions over the ids: 3 generated at v2, 2 observation ids (v2), 2 generated at v4
    old = _episode_sample([(2, 5), (4, 2)], [1, 1, 1, 0, 0, 1, 1])
    assert oldest_trained_version(old.completion, fallback=0) == 2
    # an observation id never counts: here the only v1 ids are masked
    masked = _episode_sample([(1, 2), (3, 3)], [0, 0, 1, 1, 1])
    assert oldest_trained_version(masked.completion, fallback=0) == 3
    group = Group([old, masked], start_version=1, index=0)
    assert group_oldest_version(group) == 2
    assert group_oldest_version(Group([_episode_sample([(5, 1)], [0])], start_version=4, index=1)) == 4


@pytest.mark.parametrize("trainer_version, dropped", [(3, False), (4, False), (5, True)])
def test_the_async_drop_check_bounds_the_oldest_trained_token(trainer_version, dropped):
    # max_staleness 2; the group started under v0 but its oldest trained token is v2
    spec = SimpleNamespace(schedule=SimpleNamespace(max_staleness=2, batch_prompts=1),
                           algorithm=SimpleNamespace(drop_uniform_groups=False))
    run = SimpleNamespace(spec=spec, work=SimpleNamespace(trainer=SimpleNamespace(version=trainer_version)))
    schedule = AsyncSchedule(run)
    group = Group([_episode_sample([(2, 5), (4, 2)], [1, 1, 1, 0, 0, 1, 1])], start_version=0, index=0)
    assert schedule._drop_reason(group) == ("stale" if dropped else None)
