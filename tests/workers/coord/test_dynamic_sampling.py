"""DAPO's dynamic sampling in async runs (``algorithm.drop_uniform_groups``): prompt groups
whose rewards are all equal never reach the trainer, their slots go back to the
generator, every step still trains on a full batch, and the share dropped is reported."""
import asyncio
import json

import pytest

from workers.coord.controller import Controller
from workers.spec import SpecError, validate_spec


def _spec(**algorithm):
    return {
        "name": "dapo", "model": {"path": "builtin:tiny"},
        "task": {"dataset": "gen:add?max_digits=2", "size": 400, "eval_size": 10},
        "reward": {"function": "numeric_match"},
        "algorithm": {"lr": 3e-4, "group_size": 4, "warmup_steps": 0, **algorithm},
        "rollout": {"max_tokens": 8, "update_mode": "keep"},
        "schedule": {"mode": "async", "max_staleness": 1, "batch_prompts": 4},
        "stop": {"max_steps": 5, "max_minutes": 5},
        "eval": {"every_steps": 0, "prompts": 10},
    }


class RecordingController(Controller):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained: list[list[float]] = []

    async def train_on(self, groups, step, t_start, stats=None):
        self.trained += [[s.reward for s in g.samples] for g in groups]
        return await super().train_on(groups, step, t_start, stats)


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_groups_with_equal_rewards_are_dropped_and_replaced_in_async_runs(tmp_path):
    controller = RecordingController(validate_spec(_spec(drop_uniform_groups=True)), tmp_path / "out", progress=False)
    result = asyncio.run(controller.run())
    assert result.steps == 5 and len(controller.trained) == 5 * 4  # every step a full batch
    assert all(len(set(rewards)) > 1 for rewards in controller.trained)
    assert result.dropped_uniform > 0  # the warm start gets some sums always right, some always wrong
    assert result.staleness_max <= 1
    shares = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    shares = [m["value"] for m in shares if m["key"] == "batch/dropped_uniform_share"]
    assert len(shares) == 5 and shares[-1] == pytest.approx(result.dropped_uniform / (result.dropped_uniform + 20))


@pytest.mark.parametrize("change, field", [({"schedule": {"mode": "sync"}}, "schedule.mode 'async'"),
                                           ({"algorithm": {"group_size": 1}}, "group_size >= 2")])
def test_dynamic_sampling_is_refused_where_it_cannot_fill_the_batch(change, field):
    data = _spec(drop_uniform_groups=True)
    for section, values in change.items():
        data[section] = {**data[section], **values}
    with pytest.raises(SpecError, match=field):
        validate_spec(data)
