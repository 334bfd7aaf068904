"""An async run with algorithm.advantage gae on the real engine: the critic trains beside the
policy at every step, its metrics are reported, and its DeepSpeed state is in the checkpoint
(restored exactly: tests/workers/train/test_critic.py)."""
import asyncio
import json

import pytest

from workers.coord.controller import Controller
from workers.io.checkpoint import latest_checkpoint
from workers.spec import validate_spec


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_an_async_gae_run_trains_and_checkpoints_its_critic(tmp_path):
    spec = validate_spec({
        "name": "gae", "model": {"path": "builtin:tiny"},
        "task": {"dataset": "gen:add?max_digits=2", "size": 200, "eval_size": 10},
        "reward": {"function": "numeric_match"},
        "algorithm": {"advantage": "gae", "lr": 3e-4, "group_size": 2, "warmup_steps": 0},
        "rollout": {"max_tokens": 8},
        # longest_first: the async look-ahead window with aging (workers/coord/scheduling.py) runs here too
        "schedule": {"mode": "async", "max_staleness": 1, "batch_prompts": 4, "dispatch": "longest_first"},
        "trainer": {"checkpoint_every": 2},
        "stop": {"max_steps": 4, "max_minutes": 5},
        "eval": {"every_steps": 0, "prompts": 10},
    })
    out = tmp_path / "out"
    result = asyncio.run(Controller(spec, out, progress=False).run())
    assert result.steps == 4
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    by_key = {}
    for m in metrics:
        by_key.setdefault(m["key"], []).append(m["value"])
    for key in ("critic/value_loss", "critic/explained_var", "critic/value_mean", "critic/adv_mean",
                "critic/adv_std", "critic/return_mean"):
        assert len(by_key.get(key, [])) == 4, key
    assert by_key["critic/value_mean"][0] == 0.0  # the value head starts at 0
    assert by_key["critic/value_mean"][-1] != 0.0  # and was trained
    assert by_key["critic/value_loss"][0] > 0
    checkpoint = latest_checkpoint(out)
    assert checkpoint.step == 4
    assert any((checkpoint.path / "trainer" / "critic").iterdir())
