"""Dashboard pages through Django's test client: sign-in, team isolation, empty and error
states, and what each page shows. The browser-side behaviour is in tests/browser."""
import json
import re

import pytest
from django.test import Client

from fluxrl.accounts.models import Membership, Role, Team
from fluxrl.metrics.services import ingest_points
from fluxrl.rewards.services import create_function
from fluxrl.runs.models import RunStatus
from fluxrl.runs.services import submit_run, transition

PAGES = ["/", "/runs/new/", "/compare/", "/datasets/", "/rewards/"]


@pytest.fixture
def browser_for(db):
    def make(user) -> Client:
        client = Client()
        client.force_login(user)
        return client

    return make


@pytest.fixture
def page_a(browser_for, alice):
    return browser_for(alice)


def page_data(response) -> dict:
    match = re.search(r'<script id="page-data" type="application/json">(.*?)</script>', response.content.decode(), re.S)
    return json.loads(match.group(1))


def points(key, steps, value=lambda s: s / 100):
    return [{"key": key, "step": s, "value": value(s), "time": 1763769600.0 + s} for s in steps]


@pytest.mark.parametrize("path", [*PAGES, "/runs/1/", "/runs/1/log/", "/datasets/1/", "/rewards/1/"])
def test_pages_require_sign_in(db, path):
    response = Client().get(path)
    assert response.status_code == 302 and response["Location"].startswith(f"/login/?next={path}")


def test_sign_in_with_a_password_leads_to_the_runs(alice):
    alice.set_password("s3cret-pass")
    alice.save()
    client = Client()
    assert "Sign in" in client.get("/login/").content.decode()
    wrong = client.post("/login/", {"username": "alice", "password": "nope"})
    assert wrong.status_code == 200 and "didn't match" in wrong.content.decode()
    response = client.post("/login/", {"username": "alice", "password": "s3cret-pass"})
    assert response.status_code == 302 and response["Location"] == "/"
    assert client.get("/").status_code == 200
    assert client.post("/logout/").status_code == 302 and client.get("/").status_code == 302


@pytest.mark.parametrize("path", PAGES)
def test_every_page_renders_for_a_new_team_with_nothing_in_it(page_a, path):
    response = page_a.get(path)
    assert response.status_code == 200
    assert "Team A" in response.content.decode()


def test_empty_states_say_what_to_do(page_a):
    assert "No runs yet in Team A" in page_a.get("/").content.decode()
    assert "No datasets yet" in page_a.get("/datasets/").content.decode()
    assert "No dataset to try on" in page_a.get("/rewards/").content.decode()
    assert "Pick two or more runs" in page_a.get("/compare/").content.decode()


def test_a_user_in_no_team_is_shown_how_to_start_one(browser_for, django_user_model, settings):
    loner = django_user_model.objects.create(username="loner")
    body = browser_for(loner).get("/").content.decode()  # only staff create teams (FLUXRL_TEAM_CREATION)
    assert "You are not in a team yet" in body and "Ask a team admin" in body and 'data-api="/api/teams/"' not in body
    settings.FLUXRL_TEAM_CREATION = "anyone"
    body = browser_for(loner).get("/").content.decode()
    assert "You are not in a team yet" in body and 'data-api="/api/teams/"' in body


def test_another_teams_run_dataset_and_reward_answer_404(browser_for, carol, run_a, dataset_a, team_a, alice):
    reward = create_function(team_a, alice, "mine", "def reward(prompt, completion, **f):\n    return 1.0\n")
    client = browser_for(carol)
    for path in [f"/runs/{run_a.pk}/", f"/runs/{run_a.pk}/log/", f"/datasets/{dataset_a.dataset_id}/",
                 f"/rewards/{reward.function_id}/", f"/runs/new/?from={run_a.pk}"]:
        assert client.get(path).status_code == 404, path
    assert run_a.name not in client.get("/").content.decode()


def test_compare_leaves_out_runs_of_other_teams(page_a, run_a, run_b):
    response = page_a.get(f"/compare/?runs={run_a.pk},{run_b.pk}")
    assert [r["id"] for r in page_data(response)["runs"]] == [run_a.pk]
    assert f"run {run_b.pk}" in response.content.decode()  # named as not found, not shown


def test_runs_list_shows_latest_reward_and_throughput(page_a, run_a):
    ingest_points(run_a, points("reward/mean", range(5)) + points("throughput/samples_per_s", [0, 1], lambda s: 40.5 + s))
    body = page_a.get("/").content.decode()
    assert "0.04" in body and "41.5" in body and "ppo" in body and "async η=2" in body and "baseline" in body


def test_runs_list_filters_and_sorts(page_a, team_a, alice, bob, dataset_a, spec):
    low = submit_run(team_a, alice, spec(name="low-lr", task={"dataset": "add@1"}), tags=["sweep"])
    high = submit_run(team_a, bob, spec(name="high-lr", task={"dataset": "add@1"}), notes="try 1e-3")
    transition(transition(high, RunStatus.STARTING), RunStatus.RUNNING)
    ingest_points(low, points("reward/mean", [0], lambda s: 0.2))
    ingest_points(high, points("reward/mean", [0], lambda s: 0.9))

    def names(query):
        return re.findall(r'<a href="/runs/\d+/">([^<]+)</a>', page_a.get(f"/?{query}").content.decode())

    assert names("status=running") == ["high-lr"]
    assert names("tag=sweep") == ["low-lr"]
    assert names("owner=bob") == ["high-lr"]
    assert names("q=1e-3") == ["high-lr"]
    assert names("sort=-reward") == ["high-lr", "low-lr"]
    assert names("sort=reward") == ["low-lr", "high-lr"]
    assert names("sort=duration") == ["high-lr", "low-lr"]  # not started: no duration, last
    assert "No runs match these filters" in page_a.get("/?status=failed").content.decode()


def test_team_switcher_keeps_the_choice_in_the_session(page_a, alice, team_b, run_a, run_b):
    Membership.objects.create(user=alice, team=team_b, role=Role.MEMBER)
    assert run_a.name in page_a.get("/").content.decode()
    response = page_a.post("/team/", {"team": "team-b", "next": "/datasets/"})
    assert response.status_code == 302 and response["Location"] == "/datasets/"
    body = page_a.get("/").content.decode()
    assert run_b.name in body and run_a.name not in body
    assert page_a.post("/team/", {"team": "team-b", "next": "https://evil.example/"})["Location"] == "/"


def test_switching_to_a_team_one_is_not_in_is_refused(page_a, team_b):
    assert page_a.post("/team/", {"team": "team-b"}).status_code == 404
    Team.objects.create(name="Z", slug="z")
    assert page_a.post("/team/", {"team": "z"}).status_code == 404


def test_run_page_shows_the_failure_reason(page_a, run_a):
    transition(transition(run_a, RunStatus.STARTING), RunStatus.FAILED, failure_reason="CUDA out of memory")
    body = page_a.get(f"/runs/{run_a.pk}/").content.decode()
    assert "The run failed." in body and "CUDA out of memory" in body
    assert page_data(page_a.get(f"/runs/{run_a.pk}/"))["run"]["terminal"] is True


def test_run_page_data_lists_each_series_with_its_last_step(page_a, run_a):
    ingest_points(run_a, points("reward/mean", range(7)) + points("eval/accuracy", [0, 5]) + points("staleness/hist/1", [3]))
    data = page_data(page_a.get(f"/runs/{run_a.pk}/"))
    assert data["series"] == {"reward/mean": 6, "eval/accuracy": 5, "staleness/hist/1": 3}
    assert data["since_step"] == 6 and data["run"]["status"] == "queued" and data["samples"] == []


def test_run_page_data_says_which_advantage_the_run_uses_so_a_gae_run_gets_its_critic_chart(page_a, run_a):
    assert page_data(page_a.get(f"/runs/{run_a.pk}/"))["run"]["advantage"] == "group"
    run_a.resolved_spec = {**run_a.resolved_spec, "algorithm": {**run_a.resolved_spec.get("algorithm", {}),
                                                                "advantage": "gae"}}
    run_a.save(update_fields=["resolved_spec"])
    assert page_data(page_a.get(f"/runs/{run_a.pk}/"))["run"]["advantage"] == "gae"


def test_run_page_without_metrics_has_no_since_step(page_a, run_a):
    response = page_a.get(f"/runs/{run_a.pk}/")
    assert page_data(response)["series"] == {} and page_data(response)["since_step"] is None
    assert 'rel="preload"' not in response.content.decode()


def test_run_page_preloads_the_first_charts_history(page_a, run_a):
    ingest_points(run_a, points("reward/std", [0]) + points("reward/mean", [0]))
    body = page_a.get(f"/runs/{run_a.pk}/").content.decode()
    url = f"/api/runs/{run_a.pk}/metrics/?keys=reward%2Fmean%2Creward%2Fstd&amp;max_points=1000"
    assert f'<link rel="preload" as="fetch" crossorigin="anonymous" href="{url}">' in body


def test_run_page_lists_recent_samples_newest_first(page_a, run_a):
    from fluxrl.runs.services import add_samples

    add_samples(run_a, [{"step": s, "prompt": f"{s}+1=", "completion": "42", "versions": [s, s + 1]} for s in range(25)])
    data = page_data(page_a.get(f"/runs/{run_a.pk}/"))
    assert [s["step"] for s in data["samples"]][:3] == [24, 23, 22] and len(data["samples"]) == 20
    assert data["sample_count"] == 25 and data["samples"][0]["version_runs"] == [[24, 1], [25, 1]]


def test_log_tail_of_the_engine(page_a, run_a, settings):
    assert page_a.get(f"/runs/{run_a.pk}/log/").status_code == 404
    log = settings.FLUXRL_DATA_DIR / "runs" / str(run_a.pk) / "engine.log"
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"line {i}\n" for i in range(500)))
    response = page_a.get(f"/runs/{run_a.pk}/log/")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/plain")
    text = response.content.decode()
    assert text.endswith("line 499") and "line 299" not in text


def test_new_run_form_starts_from_the_spec_defaults(page_a, dataset_a):
    body = page_a.get("/runs/new/").content.decode()
    assert 'name="model.path" data-spec data-type="str" value="builtin:tiny"' in body
    assert 'value="async" selected' in body and 'name="algorithm.group_size"' in body
    assert '<option value="add@1">' in body and '<option value="gen:add">' in body and '<option value="numeric_match">' in body
    assert 'name="reward.code"' not in body


def test_new_run_form_can_start_from_another_run(page_a, run_a):
    body = page_a.get(f"/runs/new/?from={run_a.pk}").content.decode()
    assert 'name="task.dataset" data-spec data-type="str" value="add@1"' in body and 'value="baseline"' in body


def test_new_run_form_edits_lists_as_json_and_clones_reward_components(page_a, team_a, alice, spec):
    body = page_a.get("/runs/new/").content.decode()
    assert 'name="reward.components" data-spec data-type="json" value=""' in body
    assert 'value="None"' not in body  # unset optional fields start empty
    components = [{"function": "math_answer", "weight": 0.9}, {"function": "format_boxed", "weight": 0.1}]
    run = submit_run(team_a, alice, spec(reward={"components": components}))
    body = page_a.get(f"/runs/new/?from={run.pk}").content.decode()
    value = re.search(r'name="reward.components" data-spec data-type="json" value="([^"]*)"', body).group(1)
    assert [(c["function"], c["weight"]) for c in json.loads(value.replace("&quot;", '"'))] == [
        ("math_answer", 0.9), ("format_boxed", 0.1)]
    assert re.search(r'name="reward.function" data-spec data-type="str" value="sum"', body)
    assert "0.9 × math_answer + 0.1 × format_boxed" in page_a.get(f"/runs/{run.pk}/").content.decode()


def test_a_yes_no_field_whose_default_depends_is_three_way_so_the_form_sends_nothing_unless_asked(
        page_a, team_a, alice, spec):
    # resources.engine_processes: null = processes on GPUs; a checkbox would send false and be refused there
    body = page_a.get("/runs/new/").content.decode()
    field = re.search(r'<select id="f-resources.engine_processes"[^>]*>(.*?)</select>', body, re.S)
    assert field and 'data-type="optbool"' in field.group(0)
    assert re.findall(r'<option value="([^"]*)"\s*(selected)?', field.group(1)) == [
        ("", "selected"), ("true", ""), ("false", "")]
    run = submit_run(team_a, alice, spec(resources={"engine_processes": True}))
    body = page_a.get(f"/runs/new/?from={run.pk}").content.decode()
    field = re.search(r'<select id="f-resources.engine_processes"[^>]*>(.*?)</select>', body, re.S)
    assert re.search(r'<option value="true"\s*selected', field.group(1))


def test_compare_shows_what_differs(page_a, team_a, alice, spec):
    one = submit_run(team_a, alice, spec(name="a", algorithm={"lr": 1e-4}))
    two = submit_run(team_a, alice, spec(name="b", algorithm={"lr": 3e-4}, schedule={"mode": "sync"}))
    ingest_points(one, points("reward/mean", range(3)))
    response = page_a.get(f"/compare/?run={one.pk}&run={two.pk}")
    body = response.content.decode()
    differing = re.findall(r'<tr class="differs"[^>]*>\s*<td><code>([^<]+)</code>', body)
    assert differing == ["name", "algorithm.lr", "schedule.mode"]
    data = page_data(response)
    assert data["keys"] == ["reward/mean"] and data["runs"][0]["samples_per_step"] == 64
    assert data["hyperparameters"]["final_reward"] == [0.02, None]
    assert [f["field"] for f in data["hyperparameters"]["fields"]] == ["algorithm.lr", "schedule.mode"]


def test_compare_shows_a_lora_run_beside_a_full_run(page_a, team_a, alice, spec):
    full = submit_run(team_a, alice, spec(name="full", algorithm={"lr": 1e-4}))
    lora = submit_run(team_a, alice, spec(name="lora", model={"path": "builtin:tiny", "lora": {
        "rank": 8, "target_modules": ["q_proj", "v_proj"]}}, algorithm={"lr": 2e-3}))
    for run, update in ((full, 2629632), (lora, 102528)):
        ingest_points(run, points("reward/mean", range(3)) + points("weights/update_bytes", range(3), lambda s: update)
                      + points("weights/model_bytes", range(3), lambda s: 2629632))
    response = page_a.get(f"/compare/?runs={full.pk},{lora.pk}")
    body = response.content.decode()
    assert re.findall(r'<span class="tag" data-training="\d+">([^<]+)</span>', body) == [
        "full model", "LoRA r=8 on q_proj, v_proj"]
    differing = re.findall(r'<tr class="differs"[^>]*>\s*<td><code>([^<]+)</code>', body)
    assert "model.lora.rank" in differing and "model.lora.target_modules" in differing
    row = re.search(r'<code>model.lora.rank</code>.*?</tr>', body, re.S).group(0)
    assert re.findall(r"<td>([^<]*)</td>", row) == ["–", "8"]
    assert {"weights/update_bytes", "weights/model_bytes"} <= set(page_data(response)["keys"])
    assert "LoRA r=8 on q_proj, v_proj" in page_a.get(f"/runs/{lora.pk}/").content.decode()


def test_dataset_page_previews_rows_of_a_version(page_a, dataset_a):
    body = page_a.get(f"/datasets/{dataset_a.dataset_id}/").content.decode()
    assert "first 20 of 30 rows of v1" in body and "<th scope=\"col\">prompt</th>" in body
    assert dataset_a.sha256[:12] in body
    assert "add" in page_a.get("/datasets/").content.decode()


def test_reward_page_shows_the_code_of_the_chosen_version(page_a, team_a, alice, dataset_a):
    first = create_function(team_a, alice, "exact", "def reward(prompt, completion, **f):\n    return 0.5\n")
    from fluxrl.rewards.services import add_version

    add_version(first.function, alice, "def reward(prompt, completion, **f):\n    return 0.75\n")
    body = page_a.get(f"/rewards/{first.function_id}/").content.decode()
    assert "return 0.75" in body and "Save as version 3" in body
    assert "return 0.5" in page_a.get(f"/rewards/{first.function_id}/?version=1").content.decode()
    assert '<option value="add@1">' in body  # "try it" on the team's datasets


def test_plotly_is_served_by_the_dashboard_not_a_cdn(page_a, run_a):
    body = page_a.get(f"/runs/{run_a.pk}/").content.decode()
    src = re.search(r'<script src="([^"]*plotly[^"]*)"', body).group(1)
    assert src.startswith("/vendor/plotly.min.js?v=")
    assert not re.search(r'(src|href)="(https?:)?//', body)
    response = page_a.get(src)
    assert response.status_code == 200 and "immutable" in response["Cache-Control"]
    assert b"plotly" in b"".join(response.streaming_content)[:2000].lower()


@pytest.mark.parametrize("path", ["/runs/99999999999999999999/", "/runs/99999999999999999999/log/",
                                  "/datasets/99999999999999999999/", "/rewards/99999999999999999999/",
                                  "/runs/new/?from=99999999999999999999"])
def test_out_of_range_ids_are_404(page_a, path):
    assert page_a.get(path).status_code == 404


@pytest.mark.parametrize("query", ["version=99999999999999999999", "version=x"])
def test_unknown_versions_fall_back_to_the_newest(page_a, dataset_a, query):
    assert page_a.get(f"/datasets/{dataset_a.dataset_id}/?{query}").status_code == 200


@pytest.mark.parametrize("path", PAGES)
def test_every_page_warns_when_reward_code_may_run_without_the_os_sandbox(page_a, path, monkeypatch):
    assert 'id="unsafe-sandbox-banner"' not in page_a.get(path).content.decode()
    monkeypatch.setenv("FLUXRL_UNSAFE_REWARD_CODE", "1")
    page = page_a.get(path).content.decode()
    assert 'id="unsafe-sandbox-banner"' in page and "FLUXRL_UNSAFE_REWARD_CODE=1" in page


def test_the_run_form_lists_a_nested_spec_group_as_its_own_fields_and_a_clone_refills_them():
    from fluxrl.dashboard.services import flatten, spec_form

    schedule = next(s for s in spec_form() if s["section"] == "schedule")
    fields = {f["name"]: f for f in schedule["fields"]}
    assert "schedule.long_tail" not in fields  # a group is never one text field (its default's repr)
    share = fields["schedule.long_tail.share"]
    assert share["label"] == "long tail share" and share["type"] == "float" and share["value"] == 0.1
    assert fields["schedule.long_tail.engines"]["value"] == ""  # null: left empty, the spec's default
    cloned = spec_form(flatten({"schedule": {"long_tail": {"share": 0.25, "aging": 4}}}))
    values = {f["name"]: f["value"] for s in cloned for f in s["fields"]}
    assert values["schedule.long_tail.share"] == 0.25 and values["schedule.long_tail.aging"] == 4
