"""A GAE run on the real engine whose trainer is RLHFuse's fused actor-critic pipeline
(trainer.pipeline.stages 2): it trains both models, reports the pipeline's bubble, saves a
checkpoint of its stages that a second run resumes from, and leaves no stage process."""
import asyncio
import json

import psutil
import pytest
import torch
from safetensors.torch import load_file

from workers.coord.controller import Controller
from workers.io.checkpoint import latest_checkpoint
from workers.spec import validate_spec


def _spec(max_steps: int):
    return validate_spec({
        "name": "pipeline-run", "model": {"path": "builtin:tiny"},
        "task": {"dataset": "gen:add?max_digits=2", "size": 200, "eval_size": 10},
        "reward": {"function": "numeric_match"},
        "algorithm": {"advantage": "gae", "lr": 3e-4, "group_size": 4, "warmup_steps": 0},
        "critic": {"lr": 1e-3},
        "rollout": {"max_tokens": 8},
        "schedule": {"mode": "sync", "batch_prompts": 4},
        "trainer": {"checkpoint_every": 2, "pipeline": {"stages": 2, "micro_batches": 4}},
        "stop": {"max_steps": max_steps, "max_minutes": 5},
        "eval": {"every_steps": 0, "prompts": 10},
    })


def _metrics(out) -> dict:
    by_key: dict = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        by_key.setdefault(m["key"], []).append((m["step"], m["value"]))
    return by_key


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_a_gae_run_trains_with_the_fused_pipeline_and_resumes_from_its_checkpoint(tmp_path):
    out = tmp_path / "out"
    first = Controller(_spec(2), out, progress=False)
    result = asyncio.run(first.run())
    assert result.steps == 2
    pids = first.processes.trainer.pids
    assert len(pids) == 2 and not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                      for p in pids)  # the stages ended with the run
    by_key = _metrics(out)
    assert [s for s, _ in by_key["pipeline/bubble"]] == [1, 2]
    assert all(0 <= v < 1 for _, v in by_key["pipeline/bubble"])
    assert by_key["critic/value_mean"][0][1] == 0.0 and by_key["critic/value_loss"][0][1] > 0  # the head starts at 0
    checkpoint = latest_checkpoint(out)
    assert checkpoint.step == 2 and (checkpoint.path / "trainer" / "pipeline-rank1.pt").is_file()
    final = load_file(str(out / "final_model" / "model.safetensors"))
    start = load_file(str(first.spec.model.path) + "/model.safetensors")
    assert any(not torch.equal(final[k], start[k]) for k in start if k in final)  # the policy moved

    second = Controller(_spec(3), out, progress=False, resume=checkpoint)
    result = asyncio.run(second.run())
    assert result.steps == 3
    by_key = _metrics(out)
    assert [s for s, _ in by_key["pipeline/bubble"]] == [1, 2, 3]  # step 3 once, from the checkpoint's
    assert by_key["critic/value_mean"][-1][1] != 0.0  # the restored critic, not a fresh one
