"""Team environments (POST /api/environments/): versioned code a run names in
task.environment.name, parsed but never run by the platform, invisible to other teams."""
import pytest

from fluxrl.environments.models import EnvironmentVersion

COUNTER = '''class Environment:
    def reset(self, row):
        self.turns = 0

    def step(self, text, token_ids):
        self.turns += 1
        return ("again", 0.0, self.turns >= 2)
'''


@pytest.fixture
def environment_a(team_a, alice):
    from fluxrl.environments.services import create_environment

    return create_environment(team_a, alice, "counter", COUNTER).environment


def test_create_and_add_versions(api_a):
    created = api_a.post("/api/environments/", {"name": "counter", "code": COUNTER, "description": "two turns"})
    assert created.status_code == 201, created.content
    assert (created.json()["ref"], created.json()["version"]) == ("counter@1", 1)
    pk = created.json()["environment"]
    second = api_a.post(f"/api/environments/{pk}/versions/", {"code": COUNTER.replace(">= 2", ">= 3")})
    assert second.status_code == 201 and second.json()["ref"] == "counter@2"
    listed = api_a.get("/api/environments/").json()["results"]
    assert [(e["name"], e["team"], e["latest_version"], e["ref"]) for e in listed] == [("counter", "team-a", 2, "counter@2")]
    assert ">= 3" in api_a.get(f"/api/environments/{pk}/versions/2/").json()["code"]
    assert [v["version"] for v in api_a.get(f"/api/environments/{pk}/versions/").json()["results"]] == [2, 1]
    assert EnvironmentVersion.objects.get(version=1).code == COUNTER  # versions are never rewritten


@pytest.mark.parametrize("code, message_part", [
    ("class Environment:\n    def reset(self, row)\n        pass\n", "line 2"),
    ("def step(text, token_ids):\n    return ('', 0.0, True)\n", "class Environment"),
    ("class Environment:\n    def reset(self, row):\n        pass\n", "missing: step"),
])
def test_bad_code_is_refused_before_saving_with_a_clear_error(api_a, assert_error, code, message_part):
    error = assert_error(api_a.post("/api/environments/", {"name": "bad", "code": code}), 400, field="code")
    assert message_part in error["fields"]["code"]
    assert not EnvironmentVersion.objects.exists()


def test_code_is_parsed_never_run_in_the_web_process(api_a, tmp_path):
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').write('x')\n" + COUNTER
    assert api_a.post("/api/environments/", {"name": "sneaky", "code": code}).status_code == 201
    assert not marker.exists()


def test_an_upload_over_the_size_cap_is_refused(api_a, assert_error, settings):
    settings.FLUXRL_ENVIRONMENT_CODE_MAX_BYTES = 200
    big = COUNTER + "# " + "x" * 200 + "\n"
    error = assert_error(api_a.post("/api/environments/", {"name": "big", "code": big}), 400, field="code")
    assert "200 bytes" in error["fields"]["code"]
    assert api_a.post("/api/environments/", {"name": "small", "code": COUNTER}).status_code == 201


def test_builtin_and_existing_names_cannot_be_created(api_a, environment_a, assert_error):
    for reserved in ("tools", "guess_number", "user"):
        assert_error(api_a.post("/api/environments/", {"name": reserved, "code": COUNTER}), 400, field="name")
    assert_error(api_a.post("/api/environments/", {"name": "counter", "code": COUNTER}), 409, "conflict")
    assert_error(api_a.post("/api/environments/", {"name": "a@b", "code": COUNTER}), 400, field="name")


def test_another_team_can_neither_list_nor_read_nor_add_to_it(api_b, environment_a, assert_error):
    assert api_b.get("/api/environments/").json()["results"] == []
    for method, url in [("get", f"/api/environments/{environment_a.id}/"),
                        ("get", f"/api/environments/{environment_a.id}/versions/"),
                        ("get", f"/api/environments/{environment_a.id}/versions/1/"),
                        ("post", f"/api/environments/{environment_a.id}/versions/")]:
        assert_error(getattr(api_b, method)(url, {"code": COUNTER}), 404)
    assert environment_a.versions.count() == 1


def test_the_api_schema_shows_the_endpoints(api_a):
    paths = api_a.get("/api/schema/", HTTP_ACCEPT="application/json").json()["paths"]
    assert {"/api/environments/", "/api/environments/{id}/", "/api/environments/{id}/versions/",
            "/api/environments/{id}/versions/{version}/", "/api/environments/try/",
            "/api/environments/{id}/try/"} <= set(paths)
    assert "post" in paths["/api/environments/"]


def try_code(client, code, **body):
    return client.post("/api/environments/try/", {"code": code, "row": {"prompt": "1+1=", "answer": "2"},
                                                  "turns": ["one", "two", "three"], "timeout_s": 1.0, **body})


def test_try_runs_one_episode_in_the_sandbox_until_it_ends(api_a):
    response = try_code(api_a, COUNTER)
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["ok"] is True and body["error"] is None
    assert [(s["text"], s["observation"], s["done"]) for s in body["steps"]] == [
        ("one", {"role": "tool", "content": "again"}, False), ("two", {"role": "tool", "content": "again"}, True)]


def test_try_cuts_off_a_hanging_step_and_names_why(api_a):
    hang = COUNTER.replace("        self.turns += 1\n", "        while True:\n            pass\n")
    body = try_code(api_a, hang, timeout_s=0.5).json()
    assert body["ok"] is False and "timed out" in body["error"] and len(body["steps"]) == 1
    assert api_a.get("/api/me/").status_code == 200  # the web process is fine


def test_try_a_saved_environment_by_id_and_by_reference_and_not_another_teams(api_a, api_b, environment_a,
                                                                              assert_error):
    rows = {"row": {"prompt": "p"}, "turns": ["a", "b"], "timeout_s": 1.0}
    by_id = api_a.post(f"/api/environments/{environment_a.id}/try/", rows).json()
    by_ref = api_a.post("/api/environments/try/", {"environment": "counter@1", **rows}).json()
    assert [s["done"] for s in by_id["steps"]] == [s["done"] for s in by_ref["steps"]] == [False, True]
    assert_error(api_b.post(f"/api/environments/{environment_a.id}/try/", rows), 404)
    theirs = assert_error(api_b.post("/api/environments/try/", {"environment": "counter@1", **rows}), 404)
    assert "team-a" not in theirs["message"]


def test_try_input_is_bounded(api_a, assert_error):
    assert_error(try_code(api_a, COUNTER, turns=["x"] * 9), 400, field="turns")
    assert_error(try_code(api_a, COUNTER, turns=["x"] * 8, timeout_s=5.0), 400, field="timeout_s")
    assert_error(try_code(api_a, "def step(): pass\n"), 400, field="code")
    assert_error(api_a.post("/api/environments/try/", {"turns": ["x"]}), 400)  # neither code nor environment
