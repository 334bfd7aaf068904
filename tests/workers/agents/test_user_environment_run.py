"""A run whose team environment misbehaves on some episodes: the episodes it hangs, floods or
forks in are cut off with a named reason in their sample, and the run trains on to its last step."""
import asyncio
import os

import pytest

from workers.coord.controller import Controller
from workers.io.report import Reporter
from workers.rewards.sandbox_boundary import UNSAFE_ENV
from workers.spec import validate_spec

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

STEPS = 2

# Misbehaves by the row's answer, so that every step's batch holds good and bad episodes.
CODE = '''
import os

class Environment:
    def reset(self, row):
        self.answer = int(row["answer"])
        self.turns = 0

    def step(self, text, token_ids):
        self.turns += 1
        kind = self.answer % 4
        if kind == 1:
            while True:
                pass
        if kind == 2:
            print("x" * 5_000_000)
        if kind == 3:
            os.fork()
        return "try again", 0.0, self.turns >= 2
'''


class RecordingController(Controller):
    """Keeps every trained episode's record (the reporter ships a few samples a step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.episodes = []

    async def train_on(self, groups, step, t_start, stats=None):
        self.episodes += [s.completion.episode for g in groups for s in g.samples]
        return await super().train_on(groups, step, t_start, stats)


def test_a_misbehaving_user_environment_ends_its_episodes_by_name_and_the_run_goes_on(tmp_path):
    if os.environ.get(UNSAFE_ENV) == "1":
        pytest.skip(f"{UNSAFE_ENV}=1: the operator chose to run user code without the OS sandbox")
    spec = validate_spec({
        "name": "bad-env", "model": {"path": "builtin:tiny"},
        "task": {"dataset": "gen:add?max_digits=2", "size": 200, "eval_size": 4,
                 "environment": {"name": "user", "code": CODE, "max_turns": 2, "timeout_s": 1.0,
                                 "max_episode_tokens": 64, "output_chars": 2000}},
        "reward": {"function": "numeric_match"},
        "algorithm": {"lr": 3e-4, "group_size": 2, "warmup_steps": 0},
        "rollout": {"max_tokens": 8},
        "schedule": {"mode": "sync", "batch_prompts": 8},
        "stop": {"max_steps": STEPS, "max_minutes": 10},
        "eval": {"every_steps": 0, "prompts": 4},
    })
    controller = RecordingController(spec, tmp_path / "out", reporter=Reporter(tmp_path / "out" / "metrics.jsonl"),
                                     progress=False)
    result = asyncio.run(controller.run())
    assert result.steps == STEPS
    episodes = controller.episodes
    assert len(episodes) == STEPS * 8 * 2
    details = " | ".join(e.end_detail for e in episodes if e.end_reason == "environment_error")
    assert "timed out" in details, details
    assert "output" in details, details
    assert "fork" in details, details
    # the well-behaved episodes end as the environment says, after their second turn
    assert any(e.end_reason == "done" and len(e.turns) == 2 for e in episodes), [e.end_reason for e in episodes]
