"""The dashboard in a real browser: sign in, upload a dataset, write and try a reward
function, submit a run through the form, watch its charts grow live over the websocket
as a worker reports to the ingest API, cancel runs, compare two runs; and the states a
user must be able to read (validation errors, a failed run, a dropped live connection)."""
import re
import time

import pytest
import yaml
from playwright.sync_api import expect

from workers.spec import validate_spec

pytestmark = pytest.mark.browser


def points(keys_values: dict, steps, start_time: float = 1763769600.0) -> list[dict]:
    return [{"key": key, "step": s, "value": value(s), "time": start_time + 2 * s}
            for s in steps for key, value in keys_values.items()]


REWARD_CURVE = {"reward/mean": lambda s: 0.2 + s / 100, "reward/std": lambda s: 0.1}


def trace_length(page, chart: str, trace: str) -> int:
    return page.evaluate(
        """([chart, trace]) => {
            const plot = document.getElementById(`chart-${chart}`);
            const found = (plot.data || []).find((t) => t.name === trace);
            return found ? found.x.length : -1;
        }""", [chart, trace])


def wait_for_trace_length(page, chart: str, trace: str, expected: int, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while trace_length(page, chart, trace) != expected and time.monotonic() < deadline:
        page.wait_for_timeout(100)
    assert trace_length(page, chart, trace) == expected


def test_sign_in_and_out(page, account, screenshot):
    page.goto("/")
    page.get_by_role("button", name="Sign out").click()
    page.wait_for_url("**/login/")
    page.goto("/runs/new/")
    expect(page).to_have_url(re.compile(r"/login/\?next=/runs/new/"))
    page.get_by_label("Username").fill(account["username"])
    page.get_by_label("Password").fill("wrong")
    page.get_by_label("Password").press("Enter")
    expect(page.get_by_role("alert")).to_contain_text("didn't match")
    screenshot(page, "01-sign-in-error")
    page.get_by_label("Password").fill(account["password"])
    page.get_by_label("Password").press("Enter")
    page.wait_for_url("**/runs/new/")  # back where the user was going


def test_upload_a_dataset_with_errors_shown_inline_then_preview_it(page, screenshot, tmp_path):
    page.goto("/datasets/")
    expect(page.get_by_text("No datasets yet")).to_be_visible()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\nnot json\n')
    form = page.locator("#upload-form")
    form.get_by_label("File", exact=True).set_input_files(str(bad))
    form.get_by_label("Dataset name").fill("sums")
    form.get_by_role("button", name="Upload").click()
    error = form.locator('[data-error-for="file"]')
    expect(error).to_contain_text("line 2: missing field 'answer'")
    expect(error).to_contain_text("line 3: not valid JSON")
    expect(form.get_by_label("File", exact=True)).to_have_attribute("aria-invalid", "true")
    screenshot(page, "02-dataset-upload-error")

    good = tmp_path / "sums.csv"
    good.write_text("question,solution,level\n" + "".join(f"{a}+{a + 1}=,{2 * a + 1},easy\n" for a in range(30)))
    form.get_by_label("File", exact=True).set_input_files(str(good))
    form.get_by_label("Prompt field").fill("question")
    form.get_by_label("Answer field").fill("solution")
    form.get_by_role("button", name="Upload").click()
    page.wait_for_url(re.compile(r"/datasets/\d+/\?version=1"))
    expect(page.get_by_role("heading", name="Preview: first 20 of 30 rows of v1")).to_be_visible()
    expect(page.locator("#preview-table")).to_contain_text("0+1=")
    expect(page.locator("#preview-table thead")).to_contain_text("level")
    screenshot(page, "03-dataset-preview")

    page.goto("/datasets/")
    generate = page.locator("#generate-form")
    generate.get_by_label("Generator").select_option("countdown")
    expect(generate.get_by_label("Parameters (JSON)")).to_have_value('{"numbers": 3, "max_value": 20}')
    generate.get_by_label("Rows").fill("0")
    generate.get_by_role("button", name="Generate").click()
    expect(generate.locator('[data-error-for="n"]')).to_contain_text("between 1 and")
    generate.get_by_label("Rows").fill("100")
    generate.get_by_role("button", name="Generate").click()
    page.wait_for_url(re.compile(r"/datasets/\d+/\?version=1"))
    expect(page.locator("#preview-table thead")).to_contain_text("target")
    page.goto("/datasets/")
    expect(page.locator("#datasets-table")).to_contain_text("countdown")
    expect(page.locator("#datasets-table")).to_contain_text("sums")


def test_write_a_reward_function_and_try_it_on_dataset_rows(page, api, screenshot):
    api.post("/api/datasets/generate/", {"generator": "add", "name": "adds", "n": 50, "params": {"max_digits": 2}})
    page.goto("/rewards/")
    form = page.locator("#reward-form")
    form.get_by_label("Name").fill("close-enough")
    code = form.locator("textarea[name=code]")
    code.fill("def reward(prompt, completion, answer='', **fields)\n    return 1.0\n")
    form.get_by_role("button", name="Create function").click()
    expect(form.locator('[data-error-for="code"]')).to_contain_text("line 1")  # the syntax error, by line

    code.fill("def reward(prompt, completion, answer='', **fields):\n    return 1.0 if completion.strip() == answer else 0.0\n")
    form.get_by_role("button", name="Create function").click()
    page.wait_for_url(re.compile(r"/rewards/\d+/$"))
    expect(page.get_by_role("heading", name="close-enough @1")).to_be_visible()

    # Tab indents inside the editor (Esc, then Tab, leaves it).
    code = page.locator("textarea[name=code]")
    code.click()
    page.keyboard.press("End")
    page.keyboard.press("Tab")
    assert code.input_value().endswith("    ")
    page.keyboard.press("Escape")
    page.keyboard.press("Tab")
    expect(page.get_by_role("button", name=re.compile("Save as version 2"))).to_be_focused()

    code.fill("def reward(prompt, completion, answer='', **fields):\n    return float(completion.strip() == answer)\n")
    tryit = page.locator("#try-form")
    tryit.get_by_label("Dataset").select_option("adds@1")
    tryit.get_by_label("Rows", exact=True).fill("4")
    completions = tryit.get_by_label(re.compile("Completions to score"))
    completions.fill("1\n2\n3")
    tryit.get_by_role("button", name="Try it").click()
    expect(tryit.locator('[data-error-for="completions"]')).to_contain_text("one completion per row (4 rows)")

    dataset = next(d for d in api.get("/api/datasets/")["results"] if d["name"] == "adds")
    rows = api.get(f"/api/datasets/{dataset['id']}/versions/1/preview/", limit=3)["rows"]
    tryit.get_by_label("Rows", exact=True).fill("3")
    completions.fill(f"{rows[0]['answer']}\nnope\n {rows[2]['answer']}")
    tryit.get_by_role("button", name="Try it").click()
    table = page.locator("#try-table")
    expect(table.locator("tbody tr")).to_have_count(3)
    assert table.locator("tbody tr td:nth-child(3)").all_inner_texts() == ["1", "0", "1"]
    assert table.locator("tbody tr td:nth-child(1)").all_inner_texts() == [row["prompt"] for row in rows]
    screenshot(page, "04-reward-try-it")

    code.fill("def reward(prompt, completion, **fields):\n    return 1 / 0\n")
    tryit.get_by_role("button", name="Try it").click()
    expect(page.locator("#try-result")).to_contain_text("ZeroDivisionError")
    expect(page.locator("#try-result")).to_contain_text("3 of 3 rows raised an error")


def test_submit_a_run_through_the_form_and_watch_it_grow_live(page, api, screenshot):
    page.goto("/runs/new/")
    form = page.locator("#run-form")
    form.get_by_label("name", exact=True).fill("live-demo")
    form.locator('[name="algorithm.lr"]').fill("-1")
    form.locator('[name="tags"]').fill("browser, live")
    form.get_by_role("button", name="Start run").click()
    expect(form.locator('[data-error-for="algorithm.lr"]')).to_contain_text("greater than 0")
    expect(form.locator('[name="algorithm.lr"]')).to_be_focused()
    screenshot(page, "05-new-run-validation")

    form.locator('[name="algorithm.lr"]').fill("0.001")
    form.get_by_role("button", name="Copy as YAML").click()
    expect(page.locator("#copy-output")).to_have_value(re.compile(r"lr: 0\.001"))  # filled asynchronously
    spec = yaml.safe_load(page.locator("#copy-output").input_value())
    assert validate_spec(spec).algorithm.lr == 0.001 and spec["model"]["path"] == "builtin:tiny"
    form.get_by_role("button", name="Copy as curl").click()
    expect(page.locator("#copy-output")).to_have_value(re.compile(r"^curl "))
    curl = page.locator("#copy-output").input_value()
    assert curl.startswith("curl -sS -X POST") and '"name":"live-demo"' in curl and "$FLUXRL_TOKEN" in curl

    form.get_by_role("button", name="Start run").click()
    page.wait_for_url(re.compile(r"/runs/\d+/$"))
    run_id = int(re.search(r"/runs/(\d+)/", page.url).group(1))
    expect(page.locator("#status-badge")).to_have_text("queued")
    expect(page.locator("#live-text")).to_have_text("Live")
    expect(page.get_by_text("No data yet: waiting for the workers").first).to_be_visible()
    page.evaluate("window.__sameDocument = true")  # gone if the page reloads

    worker = api.worker(run_id)
    worker.post(f"/api/runs/{run_id}/status/", {"status": "starting", "worker_host": "cpu-7", "worker_pid": 99})
    worker.post(f"/api/runs/{run_id}/status/", {"status": "running"})
    expect(page.locator("#status-badge")).to_have_text("running")
    expect(page.locator("#worker")).to_have_text("cpu-7 (pid 99)")

    hist = {f"staleness/hist/{k}": (lambda s, k=k: float(k + s % 3)) for k in range(3)}
    worker.post(f"/api/runs/{run_id}/metrics/", {"points": points({**REWARD_CURVE, **hist}, range(0, 10))})
    wait_for_trace_length(page, "reward", "reward mean", 10)
    worker.post(f"/api/runs/{run_id}/metrics/", {"points": points(REWARD_CURVE, range(10, 25))})
    worker.post(f"/api/runs/{run_id}/metrics/", {"points": points(REWARD_CURVE, range(20, 25))})  # a retried batch
    wait_for_trace_length(page, "reward", "reward mean", 25)
    wait_for_trace_length(page, "reward", "± std", 25)
    assert page.evaluate("document.getElementById('chart-staleness-hist').data[0].x.length") == 10
    worker.post(f"/api/runs/{run_id}/metrics/", {"points": points({"eval/accuracy": lambda s: 0.5, "my/custom": lambda s: s}, [24])})
    expect(page.get_by_role("heading", name="my/custom")).to_be_visible()  # an unknown key gets its own chart

    versions = [3] * 4 + [4] * 3  # the completion spans an in-flight weight update
    worker.post(f"/api/runs/{run_id}/samples/", {"samples": [
        {"uid": "s1", "step": 24, "prompt": "12+30=", "completion": "42 done", "reward": 1.0, "versions": versions},
        {"uid": "s2", "step": 24, "prompt": "1+1=", "completion": "2", "reward": 1.0, "versions": [4]}]})
    sample = page.locator("article.sample.multi")
    expect(sample).to_contain_text("spans 2 versions")
    expect(sample.locator("pre.completion span")).to_have_count(2)
    assert sample.locator("pre.completion span").all_inner_texts() == ["42 d", "one"]
    page.get_by_label("Only samples whose tokens span several policy versions").check()
    expect(page.locator("article.sample:visible")).to_have_count(1)

    assert page.evaluate("window.__sameDocument") is True
    page.locator("#chart-reward").scroll_into_view_if_needed()
    screenshot(page, "06-run-live")


MISMATCH = {"mismatch/kl": lambda s: 3e-3 * (1 + s), "mismatch/kl_stale0": lambda s: 1e-3 * (1 + s),
            "mismatch/kl_stale1": lambda s: 2e-3 * (1 + s), "mismatch/dropped_share": lambda s: 0.001 * s,
            "mismatch/ratio_p1": lambda s: 0.9, "mismatch/ratio_p50": lambda s: 1.0, "mismatch/ratio_p99": lambda s: 1.1,
            "mismatch/abs_logp_max": lambda s: 0.2,
            **{f"mismatch/ratio_hist/{edge}": (lambda s, share=share: share)
               for edge, share in [("0.8", 0.05), ("0.95", 0.9), ("1.05", 0.05)]}}


def test_the_mismatch_panel_warns_once_the_latest_kl_passes_the_threshold(page, api, screenshot):
    """The staleness-0 KL (the numerics alone) 1e-3 · (step + 1) under the default warning at
    0.01: quiet through step 5 although the KL over all tokens (with the policy's drift over
    stale ones) passes it, a warning from the live point at step 12 on, gone again when a step
    falls back below."""
    run = api.submit("mismatch")
    worker = api.worker(run["id"])
    worker.post(f"/api/runs/{run['id']}/metrics/", {"points": points(MISMATCH, range(6))})
    page.goto(f"/runs/{run['id']}/")
    expect(page.get_by_role("heading", name="Trainer/engine mismatch: KL(π_behav‖π_prox) per token")).to_be_visible()
    wait_for_trace_length(page, "mismatch", "KL, all tokens", 6)
    wait_for_trace_length(page, "mismatch-ratio", "ratio p99", 6)
    warning = page.locator("#chart-mismatch-warning")
    expect(warning).to_be_hidden()
    line = page.evaluate("document.getElementById('chart-mismatch').layout.shapes[0]")
    assert line["y0"] == line["y1"] == 0.01 and line["line"]["dash"] == "dash"
    assert page.evaluate("document.getElementById('chart-mismatch-hist').data[0].y") == ["0.8", "0.95", "1.05"]
    assert not page.get_by_role("heading", name="mismatch/ratio_hist/0.95").count()  # not an "other" chart
    expect(page.locator("#live-text")).to_have_text("Live")

    worker.post(f"/api/runs/{run['id']}/metrics/", {"points": points(MISMATCH, [12])})
    expect(warning).to_be_visible()
    expect(warning).to_contain_text("staleness-0 mismatch KL 0.0130 at step 12 is above 0.01")
    page.locator("#chart-mismatch").scroll_into_view_if_needed()
    screenshot(page, "06b-run-mismatch-warning", full_page=False)
    worker.post(f"/api/runs/{run['id']}/metrics/", {"points": points({"mismatch/kl_stale0": lambda s: 0.002}, [13])})
    expect(warning).to_be_hidden()


def test_a_dropped_live_connection_says_so_and_resumes_from_the_last_step(page, api, screenshot):
    run = api.submit("flaky-network")
    worker = api.worker(run["id"])
    worker.post(f"/api/runs/{run['id']}/metrics/", {"points": points(REWARD_CURVE, range(5))})
    urls = []

    def route(ws):
        urls.append(ws.url)
        if len(urls) <= 2:
            ws.close()  # the first attempts fail, as when a proxy drops websockets
        else:
            ws.connect_to_server()

    page.route_web_socket(re.compile(r"/ws/runs/"), route)
    page.goto(f"/runs/{run['id']}/")
    expect(page.locator("#live-text")).to_contain_text("Live updates disconnected — reconnecting in")
    expect(page.locator("#live")).to_have_attribute("data-state", "reconnecting")
    wait_for_trace_length(page, "reward", "reward mean", 5)  # the history came over REST meanwhile
    screenshot(page, "07-live-disconnected", full_page=False)
    page.get_by_role("button", name="Retry now").click()
    expect(page.locator("#live-text")).to_have_text("Live", timeout=20_000)
    assert "since_step=4" in urls[-1]  # asks only for what it missed
    worker.post(f"/api/runs/{run['id']}/metrics/", {"points": points(REWARD_CURVE, range(5, 8))})
    wait_for_trace_length(page, "reward", "reward mean", 8)


def test_a_failed_run_shows_its_reason(page, api, screenshot):
    run = api.submit("doomed")
    worker = api.worker(run["id"])
    worker.post(f"/api/runs/{run['id']}/status/", {"status": "starting"})
    page.goto(f"/runs/{run['id']}/")
    expect(page.locator("#live-text")).to_have_text("Live")
    worker.post(f"/api/runs/{run['id']}/status/", {"status": "failed", "failure_reason": "CUDA error: out of memory"})
    expect(page.get_by_role("alert")).to_contain_text("CUDA error: out of memory")
    expect(page.locator("#status-badge")).to_have_text("failed")
    expect(page.locator("#cancel-button")).to_be_hidden()
    expect(page.locator("#live-text")).to_have_text("Run ended: showing its full history")
    screenshot(page, "08-run-failed", full_page=False)


def test_cancel_a_queued_run_and_a_running_one(page, api, screenshot):
    queued = api.submit("to-cancel-queued")
    page.goto(f"/runs/{queued['id']}/")
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Cancel run").click()
    expect(page.locator("#status-badge")).to_have_text("cancelled")
    assert api.get(f"/api/runs/{queued['id']}/")["status"] == "cancelled"

    running = api.submit("to-cancel-running")
    worker = api.worker(running["id"])
    for status in ("starting", "running"):
        worker.post(f"/api/runs/{running['id']}/status/", {"status": status})
    page.goto(f"/runs/{running['id']}/")
    expect(page.locator("#live-text")).to_have_text("Live")
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Cancel run").click()
    expect(page.locator("#cancel-note")).to_be_visible()
    expect(page.locator("#cancel-button")).to_be_disabled()
    reply = worker.post(f"/api/runs/{running['id']}/status/", {"status": "running"})  # the worker's check-in
    assert reply["cancel_requested"] is True
    worker.post(f"/api/runs/{running['id']}/status/", {"status": "cancelled"})
    expect(page.locator("#status-badge")).to_have_text("cancelled")
    expect(page.locator("#timeline")).to_contain_text("cancelled")
    screenshot(page, "09-run-cancelled", full_page=False)


def test_compare_two_runs_from_the_runs_list(page, api, screenshot):
    fast = api.submit("cmp-async", tags=["cmp"], algorithm={"lr": 1e-3})
    slow = api.submit("cmp-sync", tags=["cmp"], algorithm={"lr": 3e-4}, schedule={"mode": "sync"})
    for run, rate in ((fast, 1.0), (slow, 0.5)):
        worker = api.worker(run["id"])
        curve = {"reward/mean": lambda s, r=rate: min(1.0, 0.1 + r * s / 60 + 0.05 * (s % 3)), "loss/policy": lambda s: -s / 100}
        worker.post(f"/api/runs/{run['id']}/metrics/", {"points": points(curve, range(40))})

    page.goto("/?tag=cmp")
    expect(page.locator("#runs-table tbody tr")).to_have_count(2)
    screenshot(page, "10-runs-list", full_page=False)
    page.get_by_label(f"Select run cmp-async (#{fast['id']})").check()
    page.get_by_label(f"Select run cmp-sync (#{slow['id']})").check()
    page.get_by_role("button", name="Compare selected").click()
    page.wait_for_url(re.compile(r"/compare/\?runs="))
    chart = "document.getElementById('compare-chart')"
    page.wait_for_function(f"{chart}.data && {chart}.data.length === 4")  # raw + smoothed per run
    assert sorted(page.evaluate(f"{chart}.data.filter((t) => t.showlegend !== false).map((t) => t.name)")) == [
        f"cmp-async #{fast['id']}", f"cmp-sync #{slow['id']}"]

    fields = page.locator("#diff-table tbody tr:visible td:first-child code").all_inner_texts()
    assert fields == ["name", "algorithm.lr", "schedule.mode"]
    page.wait_for_function("document.getElementById('parcoords').data && document.getElementById('parcoords').data[0].dimensions.length === 3")

    page.get_by_label("Metric", exact=True).select_option("loss/policy")
    page.get_by_label("trained samples").check()
    page.locator("#smoothing").fill("0")
    page.wait_for_function(f"{chart}.data.length === 2 && {chart}.layout.xaxis.title.text === 'trained samples'")
    assert page.evaluate(f"{chart}.data[0].x[1]") == 64  # step 1 x 8 prompts x 8 samples
    shared = page.url
    assert "metric=loss%2Fpolicy" in shared and "x=samples" in shared and "smooth=0" in shared

    page.goto(shared)  # the link shows the same view
    expect(page.get_by_label("Metric", exact=True)).to_have_value("loss/policy")
    expect(page.get_by_label("trained samples")).to_be_checked()
    page.get_by_label("Metric", exact=True).select_option("reward/mean")
    page.get_by_label("step", exact=True).check()
    page.locator("#smoothing").fill("0.8")
    page.wait_for_function(f"{chart}.data.length === 4")
    screenshot(page, "11-compare")


def test_upload_a_model_folder_with_a_refusal_shown_inline_then_see_how_to_use_it(page, tmp_path):
    from tests.platform.model_archives import RM, folder_files, tar_gz

    page.goto("/models/")
    expect(page.get_by_text("No model folders yet")).to_be_visible()
    form = page.locator("#model-upload-form")
    bad = tmp_path / "pickled.tar.gz"
    bad.write_bytes(tar_gz({"config.json": b"{}", "pytorch_model.bin": b"\x80\x04"}))
    form.get_by_label("Archive").set_input_files(str(bad))
    form.get_by_label("Model name").fill("judge")
    form.get_by_role("button", name="Upload").click()
    expect(form.locator('[data-error-for="file"]')).to_contain_text("pytorch_model.bin: pickled weights run code")

    good = tmp_path / "tiny-rm.tar.gz"
    good.write_bytes(tar_gz(folder_files(RM), top="tiny-rm/"))
    form.get_by_label("Archive").set_input_files(str(good))
    form.get_by_role("button", name="Upload").click()
    row = page.locator("#models-table tbody tr")
    expect(row).to_have_count(1)
    expect(row).to_contain_text("model:judge@1 in reward.model.path")
    expect(row).to_contain_text("Qwen2ForSequenceClassification")


def test_the_compare_page_overlays_a_gae_run_with_a_grpo_run(page, api):
    gae = api.submit("cmp-gae", tags=["rlhf"], algorithm={"advantage": "gae"})
    grpo = api.submit("cmp-grpo", tags=["rlhf"])
    critic = {"critic/value_loss": lambda s: 1.0 / (1 + s), "critic/explained_var": lambda s: min(0.9, s / 20)}
    for run, extra in ((gae, critic), (grpo, {})):
        api.worker(run["id"]).post(f"/api/runs/{run['id']}/metrics/",
                                   {"points": points({**REWARD_CURVE, **extra}, range(1, 21))})

    page.goto(f"/compare/?runs={gae['id']},{grpo['id']}")
    chart = "document.getElementById('compare-chart')"
    page.wait_for_function(f"{chart}.data && {chart}.data.length === 4")  # reward/mean: both runs, raw + smoothed
    # the critic's metrics are offered (the GAE run has them) and drawn for that run alone
    page.get_by_label("Metric", exact=True).select_option("critic/explained_var")
    page.locator("#smoothing").fill("0")
    page.wait_for_function(f"{chart}.data.length === 2 && {chart}.layout.yaxis.title.text === 'critic/explained_var'")
    lengths = page.evaluate(f"Object.fromEntries({chart}.data.map((t) => [t.name, t.y.length]))")
    assert lengths == {f"cmp-gae #{gae['id']}": 20, f"cmp-grpo #{grpo['id']}": 0}
    assert page.evaluate(f"{chart}.data[0].y.at(-1)") == pytest.approx(0.9)
    expect(page.locator("#compare-note")).to_contain_text(f"No critic/explained_var points: cmp-grpo #{grpo['id']}")
    # the algorithm is one of the differences the page lists
    fields = page.locator("#diff-table tbody tr:visible td:first-child code").all_inner_texts()
    assert fields == ["name", "algorithm.advantage"]


def test_keyboard_reaches_the_content_and_the_navigation(page):
    page.goto("/")
    page.keyboard.press("Tab")
    expect(page.get_by_role("link", name="Skip to content")).to_be_focused()
    page.keyboard.press("Tab")
    expect(page.get_by_role("link", name="FluxRL")).to_be_focused()
    page.keyboard.press("Tab")
    page.keyboard.press("Enter")
    expect(page).to_have_url(re.compile(r"/$"))
    page.get_by_role("navigation", name="Main").get_by_role("link", name="New run").focus()
    page.keyboard.press("Enter")
    page.wait_for_url("**/runs/new/")
    page.locator('[name="name"]').focus()
    page.keyboard.press("Enter")  # submits the form from the keyboard
    page.wait_for_url(re.compile(r"/runs/\d+/$"))
