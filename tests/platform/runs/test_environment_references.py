"""task.environment.name: a team environment's name@version is pinned at submission and
reaches the engine as name 'user' with its code; another team's is refused on the field
as if it did not exist. Episode samples keep their turns through the ingest API."""
import pytest

from fluxrl.environments.services import add_version, create_environment
from fluxrl.runs import live
from fluxrl.runs.models import Run
from fluxrl.runs.engine_inputs import resolve_spec
from fluxrl.runs.services import submit_run

COUNTER = '''class Environment:
    def reset(self, row):
        self.turns = 0

    def step(self, text, token_ids):
        self.turns += 1
        return ("again", 0.0, self.turns >= 2)
'''
FIELD = "spec.task.environment.name"


@pytest.fixture
def counter(team_a, alice):
    return create_environment(team_a, alice, "counter", COUNTER).environment


def with_environment(spec, **environment):
    return spec(task={"dataset": "gen:add", "environment": {"max_turns": 3, **environment}})


def test_a_team_environment_reaches_the_engine_as_user_code(api_a, counter, spec):
    response = api_a.post("/api/runs/", {"spec": with_environment(spec, name="counter@1")})
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["spec"]["task"]["environment"] == {"name": "counter@1", "max_turns": 3}  # kept as submitted
    environment = body["resolved_spec"]["task"]["environment"]
    assert (environment["name"], environment["code"], environment["max_turns"]) == ("user", COUNTER, 3)
    assert body["environment"] == "counter@1"
    run = Run.objects.get(pk=body["id"])
    dispatched = resolve_spec(run)["task"]["environment"]  # what the dispatcher writes to spec.json
    assert (dispatched["name"], dispatched["code"]) == ("user", COUNTER)


def test_the_version_is_pinned_at_submission(team_a, alice, counter, spec):
    run = submit_run(team_a, alice, with_environment(spec, name="counter"))  # the newest: 1
    add_version(counter, alice, COUNTER.replace(">= 2", ">= 5"))
    run.refresh_from_db()
    assert run.environment_version.version == 1
    assert resolve_spec(run)["task"]["environment"]["code"] == COUNTER
    newest = submit_run(team_a, alice, with_environment(spec, name="counter"))
    assert ">= 5" in newest.resolved_spec["task"]["environment"]["code"]


def test_another_teams_environment_cannot_be_selected_nor_told_apart_from_none(api_b, counter, spec, assert_error):
    theirs = assert_error(api_b.post("/api/runs/", {"spec": with_environment(spec, name="counter@1")}), 400,
                          field=FIELD)
    missing = assert_error(api_b.post("/api/runs/", {"spec": with_environment(spec, name="nosuch@1")}), 400,
                           field=FIELD)
    assert theirs["message"].replace("counter", "X") == missing["message"].replace("nosuch", "X")
    assert "team-a" not in theirs["message"] and COUNTER not in str(theirs)
    assert not Run.objects.filter(team__slug="team-b").exists()


def test_a_missing_version_is_a_400_on_the_field(api_a, counter, spec, assert_error):
    assert_error(api_a.post("/api/runs/", {"spec": with_environment(spec, name="counter@7")}), 400, field=FIELD)


def test_builtin_environments_and_inline_code_are_left_as_they_are(api_a, spec):
    body = api_a.post("/api/runs/", {"spec": with_environment(spec, name="tools", tools=["calculator"])}).json()
    assert body["resolved_spec"]["task"]["environment"]["name"] == "tools" and body["environment"] is None
    inline = api_a.post("/api/runs/", {"spec": with_environment(spec, name="user", code=COUNTER)}).json()
    assert inline["resolved_spec"]["task"]["environment"]["code"] == COUNTER and inline["environment"] is None


def test_the_run_page_config_names_the_environment_not_its_code(team_a, alice, counter, spec, client):
    run = submit_run(team_a, alice, with_environment(spec, name="counter@1"))
    client.force_login(alice)
    page = client.get(f"/runs/{run.id}/")
    assert page.status_code == 200 and page.context["page_data"]["run"]["agentic"] is True
    assert "counter@1" in page.context["spec_yaml"] and "def step" not in page.context["spec_yaml"]


EPISODE = {
    "end_reason": "done", "end_detail": "",
    "turns": [
        {"text": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347 * 29"}}\n</tool_call>',
         "generated": 3, "observed": 2, "versions": [[4, 2], [5, 1]],
         "observation": {"role": "tool", "content": "10063"},
         "tools": [{"name": "calculator", "arguments": {"expression": "347 * 29"}, "output": "10063", "error": None,
                    "ms": 0.4}], "reward": 0.0},
        {"text": "The answer is 10063.", "generated": 2, "observed": 0, "versions": [[5, 2]], "observation": None,
         "tools": [], "reward": 1.0},
    ],
}
EPISODE_SAMPLE = {"uid": "e1", "step": 2, "prompt": "347*29=", "completion": "call 10063 The answer",
                  "reward": 1.0, "versions": [4, 4, 5, 5, 5, 5, 5]}


def test_an_episode_sample_keeps_its_turns_through_ingest_the_api_and_live(run_a, worker_client, api_a):
    worker = worker_client(run_a)
    plain = {"uid": "p1", "step": 2, "prompt": "1+1=", "completion": "2", "versions": [3]}
    response = worker.post(f"/api/runs/{run_a.id}/samples/", {"samples": [plain, {**EPISODE_SAMPLE, "episode": EPISODE}]})
    assert response.status_code == 201, response.content
    stored = {s["uid"]: s for s in api_a.get(f"/api/runs/{run_a.id}/samples/").json()["results"]}
    assert stored["e1"]["episode"] == EPISODE and stored["p1"]["episode"] is None
    assert live.sample_dict(run_a.samples.get(uid="e1"))["episode"] == EPISODE


@pytest.mark.parametrize("episode, field", [
    ({**EPISODE, "turns": [{**EPISODE["turns"][0], "observation": {"role": "system", "content": "x"}}]}, "observation"),
    ({**EPISODE, "turns": [{**EPISODE["turns"][0], "versions": [[4]]}]}, "versions"),
    ({"turns": []}, "end_reason"),
])
def test_a_malformed_episode_is_refused_naming_the_field(run_a, worker_client, assert_error, episode, field):
    error = assert_error(worker_client(run_a).post(f"/api/runs/{run_a.id}/samples/",
                                                   {"samples": [{**EPISODE_SAMPLE, "episode": episode}]}), 400)
    assert any(f.startswith("samples.0.episode") and field in f for f in error["fields"]), error
    assert not run_a.samples.exists()


def test_an_episode_batch_over_the_ingest_cap_is_refused_whole(run_a, worker_client, assert_error, settings):
    settings.FLUXRL_INGEST_MAX_BYTES = 4096
    big = {**EPISODE, "end_detail": "x" * 5000}
    assert_error(worker_client(run_a).post(f"/api/runs/{run_a.id}/samples/",
                                           {"samples": [{**EPISODE_SAMPLE, "episode": big}]}), 413)
    assert not run_a.samples.exists()
