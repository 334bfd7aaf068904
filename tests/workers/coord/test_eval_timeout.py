"""Every evaluation has a timeout (eval.timeout_minutes), the one before step 0 too: an
evaluation past it is stopped, its requests cancelled, and it is reported as
eval/timed_out 1 at its step with none of its other metrics; the run goes on (evaluate
returns NaN). The controller's own evaluate, with the engine's sampling stubbed."""
import asyncio
import json
import math
import time
from types import SimpleNamespace

from workers.coord.controller import Controller
from workers.spec import validate_spec


def controller(tmp_path, timeout_minutes, delay_s):
    spec = validate_spec({"name": "t", "model": {"path": "m"}, "task": {"dataset": "gen:add"},
                          "eval": {"timeout_minutes": timeout_minutes}})
    ctrl = Controller(spec, tmp_path, progress=False)
    ctrl.evaluation.rows = [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(4)]
    ctrl.fleet.engines.append(SimpleNamespace(dead=False, index=0, active={}))
    ctrl.cancelled = 0

    async def sample(engine, row, temperature):
        try:
            await asyncio.sleep(delay_s)
        except asyncio.CancelledError:
            ctrl.cancelled += 1
            raise
        return SimpleNamespace(reward=1.0, parts={})

    ctrl.fleet.sample = sample
    return ctrl


def points(tmp_path):
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_the_evaluation_before_step_0_past_its_timeout_is_stopped_and_reported_and_the_run_goes_on(tmp_path):
    ctrl = controller(tmp_path, timeout_minutes=0.002, delay_s=60)  # 0.12 s
    t0 = time.perf_counter()
    accuracy = asyncio.run(ctrl.evaluation.evaluate(0))
    assert time.perf_counter() - t0 < 5 and math.isnan(accuracy)
    assert ctrl.cancelled == 4  # every prompt's request cancelled, none left running
    ctrl.reporter.close()
    got = {p["key"]: p for p in points(tmp_path)}
    assert got["eval/timed_out"]["value"] == 1.0 and got["eval/timed_out"]["step"] == 0
    assert "eval/accuracy" not in got


def test_an_evaluation_within_its_timeout_reports_its_metrics_and_no_timeout(tmp_path):
    ctrl = controller(tmp_path, timeout_minutes=1, delay_s=0)
    assert asyncio.run(ctrl.evaluation.evaluate(20)) == 1.0
    ctrl.reporter.close()
    got = {p["key"]: p for p in points(tmp_path)}
    assert got["eval/accuracy"]["value"] == 1.0 and got["eval/accuracy"]["step"] == 20
    assert "eval/timed_out" not in got
