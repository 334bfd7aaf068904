"""A team's environment runs only in the OS sandbox. An episode whose call hangs, forks,
floods output or raises is cut off with its named reason, while a well-behaved episode in
the same sandbox (restarted and replayed after a kill) finishes with the right answers."""
import asyncio
import os

import pytest

from workers.agents.api import Observation
from workers.agents.builtin import make_environment
from workers.agents.sandboxed import SandboxConfig, SandboxedEnvironment, SandboxPool, close_pools
from workers.rewards.sandbox_boundary import UNSAFE_ENV, boundary
from workers.spec import EnvironmentSpec

CODE = '''
import os

class Environment:
    def __init__(self, turns=3):
        self.turns = turns

    def reset(self, row):
        self.prompt, self.n = row["prompt"], 0

    def step(self, text, token_ids):
        self.n += 1
        if text == "hang":
            while True:
                pass
        if text == "flood":
            while True:
                print("x" * 1000)
        if text == "fork":
            os.fork()
        if text == "raise":
            raise ValueError("no such move")
        if text == "huge":
            return "y" * 10**6, 0.0, False
        if text == "memory":
            self.blob = bytearray(1 << 30)
        if text == "where":
            return open("/etc/hostname").read(), 0.0, False
        if self.n == 1:
            return f"{self.prompt}: {sum(token_ids)}", 0.25, False
        return {"role": "user", "content": f"turn {self.n}"}, 0.5, self.n >= self.turns
'''


@pytest.fixture(scope="module", autouse=True)
def os_boundary():
    if os.environ.get(UNSAFE_ENV) == "1":
        pytest.skip(f"{UNSAFE_ENV}=1: the operator chose to run user code without the OS sandbox")
    assert boundary().kind == "bwrap"
    yield
    close_pools()


def spec(**kw) -> EnvironmentSpec:
    return EnvironmentSpec(**{"name": "user", "code": CODE, "timeout_s": 1.0, "memory_mb": 256,
                              "output_chars": 1000, **kw})


def one_sandbox(**kw) -> SandboxPool:
    """A pool of one sandbox: every episode shares the child the bad ones break."""
    return SandboxPool(SandboxConfig.of(spec(**kw)), size=1)


def test_a_user_environment_answers_from_the_sandbox():
    async def episode():
        env = make_environment(spec(params={"turns": 2}), model_path="")
        await env.reset({"prompt": "sum", "answer": "x"})
        first = await env.step("a", [1, 2, 3])
        second = await env.step("b", [4])
        await env.close()
        return first, second

    first, second = asyncio.run(episode())
    assert (first.observation, first.reward, first.done) == (Observation("sum: 6", "tool"), 0.25, False)
    assert (second.observation, second.reward, second.done) == (Observation("turn 2", "user"), 0.5, True)


@pytest.mark.parametrize("move, error", [
    ("hang", "step timed out after 1 s"),
    ("flood", "output over 1000 characters"),
    ("fork", "PermissionError: sandbox: os.fork is not allowed in the sandbox (line 20)"),
    ("raise", "ValueError: no such move (line 22)"),
    ("huge", "ValueError: observation over 4000 characters"),
    ("memory", "MemoryError: the environment exceeded its memory limit"),
    ("where", "PermissionError: sandbox: reading /etc/hostname is not allowed (line 28)"),
])
def test_a_bad_call_ends_its_episode_by_name_while_a_good_one_in_the_same_sandbox_finishes(move, error):
    pool = one_sandbox()

    async def episodes():
        good, bad = SandboxedEnvironment(pool), SandboxedEnvironment(pool)
        await good.reset({"prompt": "good", "answer": ""})
        await bad.reset({"prompt": "bad", "answer": ""})
        assert (await good.step("a", [2, 3])).observation.content == "good: 5"
        cut = await bad.step(move, [1])
        after = await bad.step("a", [1])  # an ended episode stays ended
        rest = [await good.step("b", [1]), await good.step("c", [1])]
        await bad.close()
        await good.close()
        return cut, after, rest

    try:
        cut, after, rest = asyncio.run(episodes())
    finally:
        restarts = pool.sandboxes[0].restarts
        pool.close()
    assert cut.done and cut.error == error and cut.observation is None
    assert after.done and after.error == error
    # the good episode carries on where it was (replayed into the restarted child after a kill)
    assert [(r.observation.content, r.reward, r.done, r.error) for r in rest] == [
        ("turn 2", 0.5, False, None), ("turn 3", 0.5, True, None)]
    assert restarts == (1 if move == "hang" else 0)


def test_code_that_does_not_load_fails_every_episode_with_its_error():
    async def episode():
        env = make_environment(spec(code="class Environment:\n    def step(self, text, ids):\n        return (\n"),
                               model_path="")
        await env.reset({"prompt": "p", "answer": ""})
        return await env.step("a", [1])

    result = asyncio.run(episode())
    assert result.done and result.error.startswith("the environment code does not load: SyntaxError")


def test_a_step_returning_the_wrong_shape_is_named():
    code = "class Environment:\n    def step(self, text, ids):\n        return 'just text'\n"

    async def episode():
        env = make_environment(spec(code=code), model_path="")
        await env.reset({"prompt": "p", "answer": ""})
        return await env.step("a", [1])

    result = asyncio.run(episode())
    assert result.error == "TypeError: step must return (observation, reward, done), not str"


def test_episodes_spread_over_the_pools_sandboxes_and_are_unpinned_at_close():
    pool = SandboxPool(SandboxConfig.of(spec()), size=2)
    envs = [SandboxedEnvironment(pool) for _ in range(4)]

    async def start_then_close():
        for env in envs:
            await env.reset({"prompt": "p", "answer": ""})
        open_ = ([s.pinned for s in pool.sandboxes], {id(env.sandbox) for env in envs},
                 [len(s.episodes) for s in pool.sandboxes])
        for env in envs:
            await env.close()
        return open_

    try:
        pinned, used, held = asyncio.run(start_then_close())
        assert pinned == [2, 2] and len(used) == 2 and held == [2, 2]
        assert [s.pinned for s in pool.sandboxes] == [0, 0]
    finally:
        pool.close()
