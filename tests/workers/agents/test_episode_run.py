"""A short asynchronous run whose samples are episodes (the guess_number environment on the
tiny model): every step reports the agent metrics, the trainer's ids are the engine's on
every trained sample, and the reported samples carry their turns."""
import asyncio
import json

import pytest

from workers.agents.api import END_REASONS
from workers.agents.episode import engine_ids, loss_mask
from workers.coord.controller import Controller
from workers.io.report import Reporter
from workers.spec import validate_spec
from workers.train.batching import token_exact

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

STEPS = 3


class RecordingReporter(Reporter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.samples: list[dict] = []

    def sample(self, record: dict) -> None:
        self.samples.append(record)


class CheckingController(Controller):
    """Checks every trained sample's packed ids against the engine's, step by step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.checked = 0
        self.masked = 0

    async def train_on(self, groups, step, t_start, stats=None):
        samples = [s for g in groups for s in g.samples]
        exact = token_exact([(s.completion.prompt_ids, s.completion.token_ids) for s in samples],
                            [loss_mask(s.completion) for s in samples], [engine_ids(s.completion) for s in samples])
        assert all(exact)
        self.checked += len(exact)
        self.masked += sum(m == 0 for s in samples for m in loss_mask(s.completion))
        return await super().train_on(groups, step, t_start, stats)


def test_an_async_run_of_episodes_is_token_exact_and_reports_the_agent_metrics(tmp_path):
    spec = validate_spec({
        "name": "episodes", "model": {"path": "builtin:tiny"},
        "task": {"dataset": "gen:add?max_digits=2", "size": 200, "eval_size": 4,
                 "environment": {"name": "guess_number", "max_turns": 3, "max_observation_tokens": 64,
                                 "max_episode_tokens": 160, "rewards": "both"}},
        "reward": {"function": "numeric_match"},
        "algorithm": {"lr": 3e-4, "group_size": 2, "warmup_steps": 0},
        "rollout": {"max_tokens": 8, "update_mode": "keep"},
        "schedule": {"mode": "async", "max_staleness": 1, "batch_prompts": 2},
        "stop": {"max_steps": STEPS, "max_minutes": 10},
        "eval": {"every_steps": 0, "prompts": 4},
    })
    reporter = RecordingReporter(tmp_path / "out" / "metrics.jsonl")
    controller = CheckingController(spec, tmp_path / "out", reporter=reporter, progress=False)
    result = asyncio.run(controller.run())
    assert result.steps == STEPS
    assert controller.checked == STEPS * 2 * 2  # every trained sample checked
    points = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    by_key: dict[str, list[float]] = {}
    for p in points:
        by_key.setdefault(p["key"], []).append(p["value"])
    assert by_key["agent/token_exact"] == [1.0] * STEPS
    for key in ("agent/turns", "agent/tool_calls", "agent/tool_errors", "agent/tool_ms", "agent/observation_tokens",
                "agent/versions_per_episode", *(f"agent/end/{r}" for r in END_REASONS)):
        assert len(by_key[key]) == STEPS, key
    assert all(1.0 <= t <= 3.0 for t in by_key["agent/turns"])
    ends = [sum(by_key[f"agent/end/{r}"][k] for r in END_REASONS) for k in range(STEPS)]
    assert ends == pytest.approx([1.0] * STEPS)
    assert result.staleness_max <= 1
    episodes = [s["episode"] for s in reporter.samples if "episode" in s]
    assert episodes and all(e["end_reason"] in END_REASONS for e in episodes)
    turn = episodes[0]["turns"][0]
    assert set(turn) == {"text", "generated", "observed", "versions", "observation", "tools", "reward"}
    assert sum(n for _, n in turn["versions"]) == turn["generated"]
