import pytest

from fluxrl.rewards.services import add_version, create_function
from fluxrl.runs.models import Run
from fluxrl.runs.engine_inputs import resolve_spec

CODE = "def reward(prompt, completion, **fields):\n    return 1.0\n"


def test_submit_with_builtins_is_queued_and_keeps_the_spec_as_submitted(api_a, spec):
    submitted = spec(schedule={"mode": "sync"})
    response = api_a.post("/api/runs/", {"spec": submitted, "tags": ["sync", "baseline"], "notes": "first"})
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["status"], body["owner"], body["team"], body["tags"]) == ("queued", "alice", "team-a", ["baseline", "sync"])
    assert body["spec"] == submitted
    assert body["resolved_spec"]["schedule"]["max_staleness"] == 2  # defaults filled by workers.spec
    assert body["resolved_spec"]["task"]["dataset"] == "gen:add"


def test_team_references_resolve_to_the_stored_file_and_inlined_code(api_a, team_a, alice, dataset_a, spec):
    create_function(team_a, alice, "always", CODE)
    response = api_a.post("/api/runs/", {"spec": spec(task={"dataset": "add@1", "prompt_field": "q"},
                                                      reward={"function": "always@1", "timeout_s": 3})})
    assert response.status_code == 201, response.content
    resolved = response.json()["resolved_spec"]
    assert resolved["task"] | {"size": 0, "eval_size": 0, "seed": 0} == {
        "dataset": str(dataset_a.path), "prompt_field": "prompt", "answer_field": "answer", "size": 0, "eval_size": 0, "seed": 0,
        "prompt_format": "auto", "prompt_template": None, "system_prompt": None, "environment": None}
    assert (resolved["reward"]["function"], resolved["reward"]["code"], resolved["reward"]["timeout_s"]) == ("user", CODE, 3.0)
    assert (response.json()["dataset"], response.json()["reward"]) == ("add@1", "always@1")


def test_references_without_version_pin_the_newest_at_submission(team_a, alice, dataset_a, spec):
    from fluxrl.runs.services import submit_run

    function = create_function(team_a, alice, "always", CODE).function
    run = submit_run(team_a, alice, spec(task={"dataset": "add"}, reward={"function": "always"}))
    add_version(function, alice, CODE.replace("1.0", "0.5"))
    assert run.reward_version.version == 1
    assert resolve_spec(run)["reward"]["code"] == CODE  # later versions do not change the run


def test_a_weighted_sum_of_builtin_rewards_is_accepted_inline(api_a, spec):
    components = [{"function": "math_answer", "weight": 0.9}, {"function": "format_boxed", "weight": 0.1}]
    for reward in ({"components": components}, {"function": "sum", "components": components}):
        response = api_a.post("/api/runs/", {"spec": spec(reward=reward)})
        assert response.status_code == 201, response.content
        body = response.json()
        assert body["reward"] is None and body["resolved_spec"]["reward"]["function"] == "sum"
        assert [(c["function"], c["weight"]) for c in body["resolved_spec"]["reward"]["components"]] == [
            ("math_answer", 0.9), ("format_boxed", 0.1)]


def test_a_bad_reward_component_is_400_naming_it(api_a, spec, assert_error):
    reward = {"components": [{"function": "math_answer"}, {"function": "mine@1", "weight": 0.1}]}
    error = assert_error(api_a.post("/api/runs/", {"spec": spec(reward=reward)}), 400, "invalid",
                         field="spec.reward.components.1.function")
    assert "unknown built-in 'mine@1'" in error["fields"]["spec.reward.components.1.function"]


def test_the_example_specs_are_accepted(api_a):
    from pathlib import Path

    for example in sorted(Path(__file__).parents[3].joinpath("examples").glob("*.yaml")):  # gen:add?max_digits=2
        response = api_a.post("/api/runs/", {"spec": example.read_text()})
        assert response.status_code == 201, (example.name, response.content)


def test_yaml_text_spec_is_accepted(api_a):
    text = "name: y\nmodel: {path: 'builtin:tiny'}\ntask: {dataset: 'gen:chain'}\nstop: {max_steps: 5}\n"
    response = api_a.post("/api/runs/", {"spec": text})
    assert response.status_code == 201, response.content
    assert response.json()["spec"]["stop"] == {"max_steps": 5}


@pytest.mark.parametrize(
    "sections, field",
    [
        ({"algorithm": {"loss": "ppo", "learning_rate": 1}}, "spec.algorithm.learning_rate"),
        ({"colour": "red"}, "spec.colour"),
        ({"schedule": {"mode": "sometimes"}}, "spec.schedule.mode"),
        ({"task": {"dataset": "missing@1"}}, "spec.task.dataset"),
        ({"task": {"dataset": "gen:nope"}}, "spec.task.dataset"),
        ({"task": {"dataset": "../../etc/passwd"}}, "spec.task.dataset"),
        ({"reward": {"function": "mine@2"}}, "spec.reward.function"),
    ],
)
def test_bad_specs_are_400_naming_the_field(api_a, spec, assert_error, sections, field):
    error = assert_error(api_a.post("/api/runs/", {"spec": spec(**sections)}), 400, "invalid", field=field)
    assert field in error["message"]
    assert not Run.objects.exists()


def test_unknown_field_error_says_unknown_field(api_a, spec, assert_error):
    error = assert_error(api_a.post("/api/runs/", {"spec": spec(rollout={"enginez": 2})}), 400)
    assert error["fields"] == {"spec.rollout.enginez": "unknown field"}


def test_another_teams_dataset_cannot_be_referenced(api_b, dataset_a, spec, assert_error):
    assert_error(api_b.post("/api/runs/", {"spec": spec(task={"dataset": "add@1"})}), 400, field="spec.task.dataset")


def test_list_filters_by_status_tag_owner_and_text(api_a, run_a, team_a, bob, spec):
    from fluxrl.runs.services import cancel_run, submit_run

    other = submit_run(team_a, bob, spec(name="bobs-sweep"), tags=["sweep"], notes="lr sweep")
    cancel_run(other)

    def ids(**query):
        return [r["id"] for r in api_a.get("/api/runs/", query).json()["results"]]

    assert ids() == [other.id, run_a.id]
    assert ids(status="queued") == [run_a.id]
    assert ids(status="queued,cancelled") == [other.id, run_a.id]
    assert ids(tag="sweep") == [other.id]
    assert ids(owner="alice") == [run_a.id]
    assert ids(q="LR SWEEP") == [other.id]
    assert ids(team="team-a", tag="nope") == []


def test_runs_of_other_teams_are_invisible(api_b, run_a, run_b, assert_error):
    assert [r["id"] for r in api_b.get("/api/runs/").json()["results"]] == [run_b.id]
    assert_error(api_b.get(f"/api/runs/{run_a.id}/"), 404, "not_found")
    assert_error(api_b.patch(f"/api/runs/{run_a.id}/", {"notes": "x"}), 404)
    assert_error(api_b.post(f"/api/runs/{run_a.id}/cancel/"), 404)


def test_tags_and_notes_can_be_edited(api_a, run_a, assert_error):
    response = api_a.patch(f"/api/runs/{run_a.id}/", {"tags": ["keep", "eta2"], "notes": "good one"})
    assert response.status_code == 200
    assert (response.json()["tags"], response.json()["notes"]) == (["eta2", "keep"], "good one")
    assert_error(api_a.patch(f"/api/runs/{run_a.id}/", {"tags": ["has space"]}), 400, field="tags")
