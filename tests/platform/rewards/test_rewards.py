import pytest

from fluxrl.rewards.models import RewardVersion

EXACT = "def reward(prompt, completion, answer='', **fields):\n    return float(completion.strip() == answer)\n"


@pytest.fixture
def reward_a(team_a, alice):
    from fluxrl.rewards.services import create_function

    return create_function(team_a, alice, "exact", EXACT).function


def try_code(client, code, **body):
    body.setdefault("rows", [{"prompt": "1+1=", "completion": "2", "fields": {"answer": "2"}}])
    return client.post("/api/rewards/try/", {"code": code, "timeout_s": 1.0, **body})


def test_list_shows_builtins_first_then_team_functions(api_a, api_b, reward_a):
    items = api_a.get("/api/rewards/").json()["results"]
    builtins = [i["name"] for i in items if i["builtin"]]
    assert {"exact_match", "numeric_match", "format_check", "length_penalty"} <= set(builtins)
    assert items[-1] == {**items[-1], "name": "exact", "builtin": False, "team": "team-a", "ref": "exact@1"}
    assert all(i["builtin"] for i in api_b.get("/api/rewards/").json()["results"])
    assert items[0] | {"name": "x", "description": "x", "ref": "x"} == {
        "id": None, "team": None, "name": "x", "builtin": True, "description": "x", "latest_version": None, "ref": "x",
        "created_at": None}


def test_create_and_add_versions(api_a):
    created = api_a.post("/api/rewards/", {"name": "exact", "code": EXACT, "description": "strict"})
    assert created.status_code == 201 and created.json()["ref"] == "exact@1"
    function_id = created.json()["function"]
    second = api_a.post(f"/api/rewards/{function_id}/versions/", {"code": EXACT.replace("strip()", "lower()")})
    assert second.status_code == 201 and second.json()["version"] == 2
    assert api_a.get(f"/api/rewards/{function_id}/").json()["latest_version"] == 2
    assert "lower()" in api_a.get(f"/api/rewards/{function_id}/versions/2/").json()["code"]
    assert RewardVersion.objects.get(version=1).code == EXACT


@pytest.mark.parametrize(
    "code, message_part",
    [("def reward(prompt, completion:\n  pass", "line 1"), ("def score(p, c):\n    return 1.0\n", "must define")],
)
def test_code_with_syntax_error_or_without_reward_is_rejected_before_saving(api_a, assert_error, code, message_part):
    error = assert_error(api_a.post("/api/rewards/", {"name": "bad", "code": code}), 400, field="code")
    assert message_part in error["fields"]["code"]
    assert not RewardVersion.objects.exists()


def test_builtin_names_and_existing_names_cannot_be_created(api_a, reward_a, assert_error):
    assert_error(api_a.post("/api/rewards/", {"name": "numeric_match", "code": EXACT}), 400, field="name")
    for reserved in ("sum", "user"):  # reward.function values of their own
        assert_error(api_a.post("/api/rewards/", {"name": reserved, "code": EXACT}), 400, field="name")
    assert_error(api_a.post("/api/rewards/", {"name": "exact", "code": EXACT}), 409, "conflict")


def test_try_scores_rows_in_the_sandbox(api_a):
    response = try_code(api_a, EXACT, rows=[{"prompt": "1+1=", "completion": "2", "fields": {"answer": "2"}},
                                            {"prompt": "1+2=", "completion": "4", "fields": {"answer": "3"}}])
    assert response.status_code == 200
    body = response.json()
    assert body["ok"] is True and [r["reward"] for r in body["results"]] == [1.0, 0.0]
    assert body["results"][1]["completion"] == "4"


def test_try_with_raising_code_reports_the_error_per_row(api_a):
    body = try_code(api_a, "def reward(prompt, completion, **f):\n    return 1 / 0\n").json()
    assert body["ok"] is False
    assert body["results"][0]["reward"] is None and "ZeroDivisionError" in body["results"][0]["error"]
    assert "line 2" in body["results"][0]["error"]


def test_try_with_an_endless_loop_times_out(api_a):
    body = try_code(api_a, "def reward(prompt, completion, **f):\n    while True:\n        pass\n").json()
    assert body["ok"] is False and "timed out" in body["results"][0]["error"]


def test_try_with_memory_hungry_code_hits_its_memory_limit(api_a):
    code = "def reward(prompt, completion, **f):\n    blob = bytearray(4 * 1024 ** 3)\n    return 1.0\n"
    body = try_code(api_a, code, memory_mb=128).json()
    assert body["ok"] is False and "MemoryError" in body["results"][0]["error"]
    assert api_a.get("/api/me/").status_code == 200  # the web process is fine


def test_try_with_code_that_fails_to_load_reports_it(api_a):
    body = try_code(api_a, "import socket\nreward = 1\n").json()
    assert body["ok"] is False and body["results"] == [] and body["error"]


def test_try_builtin_on_dataset_rows_uses_answers_as_completions(api_a, dataset_a):
    body = api_a.post("/api/rewards/try/", {"function": "numeric_match", "dataset": "add@1", "n": 3}).json()
    assert [r["reward"] for r in body["results"]] == [1.0, 1.0, 1.0]
    wrong = api_a.post("/api/rewards/try/", {"function": "numeric_match", "dataset": "add", "n": 2,
                                             "completions": ["-1", "-2"]}).json()
    assert [r["reward"] for r in wrong["results"]] == [0.0, 0.0]


def test_try_saved_function_by_id_and_by_reference(api_a, reward_a, dataset_a):
    by_id = api_a.post(f"/api/rewards/{reward_a.id}/try/", {"dataset": "add@1", "n": 2}).json()
    by_ref = api_a.post("/api/rewards/try/", {"function": "exact@1", "dataset": "add@1", "n": 2}).json()
    assert [r["reward"] for r in by_id["results"]] == [r["reward"] for r in by_ref["results"]] == [1.0, 1.0]


def test_try_input_errors_are_400_or_404(api_a, dataset_a, assert_error):
    assert_error(api_a.post("/api/rewards/try/", {"code": EXACT}), 400)  # no rows nor dataset
    assert_error(api_a.post("/api/rewards/try/", {"rows": [], "dataset": "x"}), 400)
    assert_error(api_a.post("/api/rewards/try/", {"function": "nope@1", "rows": []}), 404)
    too_many = [{"prompt": "p", "completion": "c"}] * 21
    assert_error(api_a.post("/api/rewards/try/", {"code": EXACT, "rows": too_many}), 400, field="rows")
    assert_error(api_a.post("/api/rewards/try/", {"function": "numeric_match", "dataset": "add", "n": 2,
                                                  "completions": ["1"]}), 400, field="completions")
    assert_error(api_a.post("/api/rewards/try/", {"function": "numeric_match", "dataset": "nope@1"}), 404)


def test_another_teams_reward_function_is_404(api_b, reward_a, assert_error):
    for method, url in [("get", f"/api/rewards/{reward_a.id}/"), ("get", f"/api/rewards/{reward_a.id}/versions/"),
                        ("post", f"/api/rewards/{reward_a.id}/versions/"), ("post", f"/api/rewards/{reward_a.id}/try/")]:
        assert_error(getattr(api_b, method)(url, {"code": EXACT, "rows": []}), 404)
    assert_error(api_b.post("/api/rewards/try/", {"function": "exact@1", "rows": [{"prompt": "p", "completion": "c"}]}), 404)


def test_reward_code_over_the_size_limit_is_400_naming_the_limit_and_huge_bodies_413(api_a, settings, assert_error):
    settings.FLUXRL_REWARD_CODE_MAX_BYTES = 100
    code = "def reward(prompt, completion, **fields):\n    return 1.0\n" + "#" * 100
    error = assert_error(api_a.post("/api/rewards/", {"name": "big", "code": code}, format="json"), 400, field="code")
    assert "longer than 100 bytes" in error["fields"]["code"]
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    assert_error(api_a.post("/api/rewards/", {"name": "big", "code": "#" * 2000}, format="json"), 413, "too_large")


def test_try_on_more_dataset_rows_than_can_exist_is_400_not_a_server_error(api_a, dataset_a, assert_error):
    body = {"function": "numeric_match", "dataset": "add@1", "n": 2**63}
    assert_error(api_a.post("/api/rewards/try/", body, format="json"), 400, field="n")
