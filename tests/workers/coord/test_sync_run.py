"""Sync runs on two rollout engines, barrier and streamed training: every step trains a
full batch with no staleness, and the running count of moved sequences is reported every
step. The barrier run gathers each step's tail onto one engine (rollout.gather_tail); the
streamed run spreads it (migrate_tail) and dispatches skew_aware (one long-tail engine,
vLLM priorities). In this process (not through the CLI, whose run path
test_cli.py's demo run covers): one interpreter importing torch and vLLM fewer per run."""
import asyncio
import json

import pytest

from workers.coord.controller import Controller
from workers.spec import validate_spec


class GatherWatcher(Controller):
    """Notes, for every sample scored, the engine it finished on and the engine the step's
    tail was gathered onto at that moment (scoring is fused: inside the step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.finished_on = []

    async def _score(self, row, comp):
        self.finished_on.append((comp.resubmits, comp.engine, self.fleet.tail.gather_onto))
        return await super()._score(row, comp)


@pytest.mark.engine
@pytest.mark.timeout(900)
@pytest.mark.parametrize("stream_train", [False, True], ids=["barrier", "streamed"])
def test_sync_run_on_two_engines_moving_its_tail_trains_every_step(tmp_path, tiny_model_path, stream_train):
    spec = validate_spec({
        "name": "sync-migrate", "model": {"path": "builtin:tiny"},
        "task": {"dataset": "gen:chain?max_value=10&max_terms=12", "size": 300, "eval_size": 4},
        "reward": {"function": "numeric_match"},
        "algorithm": {"loss": "ppo", "group_size": 4, "lr": 1.0e-4},
        "rollout": {"engines": 2, "max_tokens": 32, "update_mode": "keep",
                    # gather: any 16 or fewer, i.e. as soon as both engines run a step's 16 sequences
                    **({"migrate_tail": 1000} if stream_train else {"gather_tail": 16})},
        "schedule": {"mode": "sync", "max_staleness": 1, "batch_prompts": 4, "stream_train": stream_train,
                     "dispatch": "skew_aware" if stream_train else "fifo"},
        "stop": {"max_steps": 3, "max_minutes": 5},
        "eval": {"every_steps": 0, "prompts": 4},
    })
    controller = GatherWatcher(spec, tmp_path / "out", progress=False)
    result = asyncio.run(controller.run())
    assert result.steps == 3 and result.trained_samples == 3 * 4 * 4 and result.staleness_max == 0
    points = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    migrations = [p["value"] for p in points if p["key"] == "rollout/migrations"]
    assert len(migrations) == 3 and migrations == sorted(migrations)  # a running count, reported every step
    assert migrations[-1] > 0
    if not stream_train:  # every sequence handed off finished on the engine the tail was gathered onto
        moved = [(engine, onto) for resubmits, engine, onto in controller.finished_on if resubmits]
        # (one aborted just as it finished by itself is not continued: at most the count moved)
        assert 0 < len(moved) <= migrations[-1] and all(engine == onto for engine, onto in moved)
    tail_shares = [p["value"] for p in points if p["key"] == "generation/long_tail_share"]
    assert len(tail_shares) == 3 and all(0 <= v < 1 for v in tail_shares)
    long_tail_engines = [p["value"] for p in points if p["key"] == "dispatch/long_tail_engines"]
    assert long_tail_engines == ([1, 1, 1] if stream_train else [])  # one of two engines serves the long tail
