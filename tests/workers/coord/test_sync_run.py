"""Sync runs on two rollout engines with tail migration, barrier and streamed training:
every step trains a full batch with no staleness, and the running count of migrated
sequences is reported every step. In this process (not through the CLI, whose run path
test_cli.py's demo run covers): one interpreter importing torch and vLLM fewer per run."""
import asyncio
import json

import pytest

from workers.coord.controller import Controller
from workers.spec import validate_spec


@pytest.mark.engine
@pytest.mark.timeout(900)
@pytest.mark.parametrize("stream_train", [False, True], ids=["barrier", "streamed"])
def test_sync_run_on_two_engines_with_tail_migration_trains_every_step(tmp_path, tiny_model_path, stream_train):
    spec = validate_spec({
        "name": "sync-migrate", "model": {"path": "builtin:tiny"},
        "task": {"dataset": "gen:chain?max_value=10&max_terms=12", "size": 300, "eval_size": 4},
        "reward": {"function": "numeric_match"},
        "algorithm": {"loss": "ppo", "group_size": 4, "lr": 1.0e-4},
        "rollout": {"engines": 2, "max_tokens": 32, "update_mode": "keep", "migrate_tail": 1000},
        "schedule": {"mode": "sync", "max_staleness": 1, "batch_prompts": 4, "stream_train": stream_train},
        "stop": {"max_steps": 3, "max_minutes": 5},
        "eval": {"every_steps": 0, "prompts": 4},
    })
    result = asyncio.run(Controller(spec, tmp_path / "out", progress=False).run())
    assert result.steps == 3 and result.trained_samples == 3 * 4 * 4 and result.staleness_max == 0
    points = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    migrations = [p["value"] for p in points if p["key"] == "rollout/migrations"]
    assert len(migrations) == 3 and migrations == sorted(migrations)  # a running count, reported every step
