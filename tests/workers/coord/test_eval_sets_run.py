"""A short real run (tiny model, vLLM, DeepSpeed) with two evaluation sets (eval.sets): a
file of its own scored by a reward of its own, and the run's held-out split. Each set's
pass@k and avg@n are reported at every evaluation, lie in [0, 1], and pass@k does not fall
as k grows. Synchronous (each prompt's n samples one vLLM request), and asynchronous with
interrupting updates (a request per sample, since such engines resume each sequence on its own)."""
import asyncio
import json

import pytest

from workers.coord.controller import Controller
from workers.spec import validate_spec
from workers.tasks.datasets import GENERATORS


@pytest.mark.engine
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode,update_mode", [pytest.param("sync", "keep", marks=pytest.mark.slow), ("async", "interrupt")],
                         ids=["sync", "async-interrupt"])
def test_a_run_reports_pass_at_k_and_avg_at_n_for_each_eval_set(tmp_path, mode, update_mode):
    rows = GENERATORS["add"](6, seed=7)
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"question": r["prompt"], "solution": r["answer"]}) + "\n" for r in rows))
    spec = validate_spec({
        "name": "eval-sets", "model": {"path": "builtin:tiny"},
        "task": {"dataset": "gen:add", "size": 200, "eval_size": 8},
        "algorithm": {"group_size": 4},
        "rollout": {"max_tokens": 12, "temperature": 1.0, "update_mode": update_mode},
        "schedule": {"mode": mode, "batch_prompts": 4},
        "stop": {"max_steps": 2, "max_minutes": 5},
        "eval": {"every_steps": 1, "prompts": 4, "sets": [
            {"name": "file", "dataset": str(held), "prompt_field": "question", "answer_field": "solution",
             "reward": {"components": [{"function": "numeric_match"}]}, "n": 8, "k": [1, 2, 4, 8], "prompts": 5},
            {"name": "own", "n": 4, "temperature": 0.7},
        ]},
    })
    out = tmp_path / "out"
    result = asyncio.run(Controller(spec, out, progress=False).run())
    assert result.steps == 2
    points = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    by_step: dict[int, dict[str, float]] = {}
    for p in points:
        if p["key"].startswith("eval/"):
            by_step.setdefault(p["step"], {})[p["key"]] = p["value"]
    assert sorted(by_step) == [0, 1, 2]  # before, every step (step 2 is the final one)
    for step, metrics in by_step.items():
        assert "eval/accuracy" in metrics  # the greedy held-out accuracy is still there
        file_keys = [f"eval/file/pass@{k}" for k in (1, 2, 4, 8)] + ["eval/file/avg@8"]
        own_keys = ["eval/own/pass@1", "eval/own/pass@4", "eval/own/avg@4"]
        assert set(file_keys + own_keys) <= set(metrics), (step, sorted(metrics))
        assert all(0.0 <= metrics[k] <= 1.0 for k in file_keys + own_keys)
        passes = [metrics[f"eval/file/pass@{k}"] for k in (1, 2, 4, 8)]
        assert passes == sorted(passes), (step, passes)  # pass@k is non-decreasing in k
        assert metrics["eval/own/pass@4"] >= metrics["eval/own/pass@1"]
        # with a 0/1 reward and pass_reward 1, pass@1 is the mean reward over the n samples
        assert metrics["eval/file/pass@1"] == pytest.approx(metrics["eval/file/avg@8"])
        assert metrics["eval/own/pass@1"] == pytest.approx(metrics["eval/own/avg@4"])
    # the tiny model gets some of its additions right when it samples 8 times
    assert max(m["eval/file/pass@8"] for m in by_step.values()) > 0
