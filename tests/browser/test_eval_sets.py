"""pass@k on the run page and the compare page, in a real browser: a run submitted with
two evaluation sets (eval.sets) reports eval/<set>/pass@<k> and avg@<n> as its worker
would; each set gets a chart of its own beside the held-out accuracy, which grows live
(a new k, a new set), and the compare page overlays one set's pass@k of two runs."""
import re

import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

SETS = [{"name": "gsm", "n": 8, "k": [1, 4, 8]}, {"name": "chain-hard", "dataset": "gen:chain", "n": 4}]


def eval_points(name: str, values: dict, steps, scale: float = 1.0) -> list[dict]:
    return [{"key": f"eval/{name}/{metric}", "step": s, "value": min(1.0, scale * base * (1 + s / 20)),
             "time": 1763769600.0 + 2 * s} for s in steps for metric, base in values.items()]


def chart_traces(page, heading: str) -> dict[str, list]:
    """The traces (name -> [x, y]) of the chart under this heading."""
    return page.evaluate("""(heading) => {
        const box = [...document.querySelectorAll("section.chart-box")].find((b) => b.querySelector("h3").textContent === heading);
        const plot = box.querySelector(".chart");
        return Object.fromEntries((plot.data || []).map((t) => [t.name, [Array.from(t.x), Array.from(t.y)]]));
    }""", heading)


def test_pass_at_k_of_each_eval_set_shows_on_the_run_page_and_the_compare_page(page, api, screenshot):
    run = api.submit("passk", tags=["passk"], eval={"every_steps": 5, "sets": SETS})
    other = api.submit("passk-b", tags=["passk"], algorithm={"lr": 1e-4}, eval={"every_steps": 5, "sets": SETS})
    gsm = {"pass@1": 0.3, "pass@4": 0.55, "pass@8": 0.7, "avg@8": 0.3}
    for one, scale in ((run, 1.0), (other, 0.5)):
        worker = api.worker(one["id"])
        worker.post(f"/api/runs/{one['id']}/status/", {"status": "starting", "worker_host": "cpu-1", "worker_pid": 9})
        worker.post(f"/api/runs/{one['id']}/status/", {"status": "running"})
        worker.post(f"/api/runs/{one['id']}/metrics/", {"points": eval_points("gsm", gsm, [0, 5, 10], scale) + [
            {"key": "eval/accuracy", "step": s, "value": 0.2, "time": 1763769600.0 + s} for s in (0, 5, 10)]})

    page.goto(f"/runs/{run['id']}/")
    title = "Eval set gsm: pass@k and avg@n"
    expect(page.get_by_role("heading", name=title)).to_be_visible()
    page.wait_for_function("""(heading) => [...document.querySelectorAll("section.chart-box")]
        .some((b) => b.querySelector("h3").textContent === heading && (b.querySelector(".chart").data || []).length === 4)""",
                           arg=title)
    traces = chart_traces(page, title)
    assert list(traces) == ["pass@1", "pass@4", "pass@8", "avg@8"]  # pass@k by k, then avg@n
    assert traces["pass@8"][0] == [0, 5, 10]
    assert traces["pass@8"][1] == pytest.approx([0.7, 0.875, 1.0])
    assert traces["pass@1"][1] == pytest.approx([0.3, 0.375, 0.45])
    # the set's chart comes right after the held-out accuracy; its keys are not "other" metrics
    headings = page.locator("#charts h3").all_inner_texts()
    assert headings[headings.index("Held-out accuracy") + 1] == title
    expect(page.locator("#other-metrics-section")).to_be_hidden()

    # live: a new k of the set, and the other set's first evaluation
    worker = api.worker(run["id"])
    worker.post(f"/api/runs/{run['id']}/metrics/", {"points": eval_points("gsm", {"pass@2": 0.45}, [15])
                + eval_points("chain-hard", {"pass@1": 0.1, "pass@4": 0.25, "avg@4": 0.1}, [15])})
    hard = "Eval set chain-hard: pass@k and avg@n"
    expect(page.get_by_role("heading", name=hard)).to_be_visible()
    page.wait_for_function("""(heading) => [...document.querySelectorAll("section.chart-box")]
        .some((b) => b.querySelector("h3").textContent === heading && (b.querySelector(".chart").data || []).length === 5)""",
                           arg=title)
    assert chart_traces(page, title)["pass@2"][0] == [15]
    assert list(chart_traces(page, hard)) == ["pass@1", "pass@4", "avg@4"]
    assert chart_traces(page, hard)["pass@4"][1] == pytest.approx([0.25 * 1.75])
    page.locator("#chart-eval-0").scroll_into_view_if_needed()
    screenshot(page, "20-run-pass-at-k", full_page=False)

    # the compare page: one set's pass@k of both runs, picked from the metric list
    page.goto(f"/compare/?runs={run['id']},{other['id']}&metric=eval/gsm/pass@8&smooth=0")
    expect(page.get_by_label("Metric", exact=True)).to_have_value("eval/gsm/pass@8")
    chart = "document.getElementById('compare-chart')"
    page.wait_for_function(f"{chart}.data && {chart}.data.length === 2")
    series = page.evaluate(f"{chart}.data.map((t) => [t.name, Array.from(t.y)])")
    assert series[0][0] == f"passk #{run['id']}" and series[0][1] == pytest.approx([0.7, 0.875, 1.0])
    assert series[1][0] == f"passk-b #{other['id']}" and series[1][1] == pytest.approx([0.35, 0.4375, 0.525])
    assert page.evaluate(f"{chart}.layout.yaxis.title.text") == "eval/gsm/pass@8"
    page.get_by_label("Metric", exact=True).select_option("eval/gsm/avg@8")
    page.wait_for_function(f"{chart}.layout.yaxis.title.text === 'eval/gsm/avg@8'")
    assert re.search(r"metric=eval%2Fgsm%2Favg%408", page.url)
    screenshot(page, "21-compare-pass-at-k", full_page=False)
