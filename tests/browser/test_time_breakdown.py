"""The run page's "Time per step" chart in a real browser: a worker posts each step's
time/<part>_s through the ingest API; the page draws them as one stacked bar per step,
from the history and then live over the websocket, and keeps them out of "Other metrics"."""
import time

import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

PARTS = {"time/generation_s": "generation", "time/scoring_s": "scoring", "time/gate_wait_s": "staleness gate wait",
         "time/forward_s": "trainer forward", "time/backward_s": "trainer backward",
         "time/optimizer_s": "optimizer", "time/weight_update_s": "weight update", "time/eval_s": "evaluation",
         "time/idle_s": "idle"}


def step_times(step: int) -> dict[str, float]:
    """A step of 10 s: generation grows with the step, idle takes the rest."""
    parts = {"time/generation_s": 1.0 + step, "time/scoring_s": 0.5, "time/gate_wait_s": 0.25,
             "time/forward_s": 1.0, "time/backward_s": 2.0, "time/optimizer_s": 0.5,
             "time/weight_update_s": 0.25, "time/eval_s": 0.0}
    parts["time/idle_s"] = 10.0 - sum(parts.values())
    return {**parts, "time/step_s": 10.0}


def points(steps) -> list[dict]:
    return [{"key": key, "step": s, "value": value, "time": 1763769600.0 + s}
            for s in steps for key, value in step_times(s).items()]


def bars(page) -> list[dict]:
    return page.evaluate("""() => (document.getElementById('chart-time').data || []).map(
        (t) => ({name: t.name, type: t.type, x: [...t.x], y: [...t.y]}))""")


def wait_for_steps(page, steps: list[int], timeout_s: float = 20) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        traces = bars(page)
        if traces and all(t["x"] == steps for t in traces):
            return traces
        page.wait_for_timeout(100)
    raise AssertionError(f"the time chart never held steps {steps}: {bars(page)}")


def test_the_run_page_stacks_each_steps_time_parts_from_history_and_live(page, api, screenshot):
    run = api.submit("time-breakdown")
    worker = api.worker(run["id"])
    worker.post(f"/api/runs/{run['id']}/status/", {"status": "starting", "worker_host": "cpu-1", "worker_pid": 7})
    worker.post(f"/api/runs/{run['id']}/status/", {"status": "running"})
    worker.post(f"/api/runs/{run['id']}/metrics/", {"points": points([1, 2, 3])})
    page.goto(f"/runs/{run['id']}/")
    expect(page.get_by_role("heading", name="Time per step (seconds, stacked)")).to_be_visible()
    traces = wait_for_steps(page, [1, 2, 3])
    assert [t["name"] for t in traces] == list(PARTS.values()) and {t["type"] for t in traces} == {"bar"}
    assert page.evaluate("document.getElementById('chart-time').layout.barmode") == "stack"
    by_name = {t["name"]: t["y"] for t in traces}
    assert by_name["generation"] == [2.0, 3.0, 4.0] and by_name["idle"] == [3.5, 2.5, 1.5]
    # each bar's parts add up to the step's wall time
    assert [sum(t["y"][i] for t in traces) for i in range(3)] == [10.0, 10.0, 10.0]
    # placed beside the throughput chart, and no part is an "other metric"
    assert page.evaluate("document.getElementById('chart-throughput').closest('section').nextElementSibling.id") \
        == "" and page.evaluate(
        "document.getElementById('chart-throughput').closest('section').nextElementSibling"
        ".querySelector('.chart').id") == "chart-time"
    assert not page.get_by_role("heading", name="time/generation_s").count()
    assert not page.get_by_role("heading", name="time/step_s").count()
    expect(page.locator("#live-text")).to_have_text("Live")

    worker.post(f"/api/runs/{run['id']}/metrics/", {"points": points([3, 4])})  # step 3 again: a retried batch
    traces = wait_for_steps(page, [1, 2, 3, 4])
    assert {t["name"]: t["y"][-1] for t in traces}["generation"] == 5.0
    page.locator("#chart-time").scroll_into_view_if_needed()
    screenshot(page, "06c-run-time-per-step", full_page=False)
