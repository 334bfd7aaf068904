"""eval.sets on the platform: a set's dataset and reward function are the team's own
versions, pinned at submission and resolved again at dispatch; another team's are refused,
and so is a file path on the worker host."""
from fluxrl.datasets.services import generate_version
from fluxrl.rewards.services import add_version, create_function
from fluxrl.runs.engine_inputs import resolve_spec
from fluxrl.runs.services import submit_run

CODE = "def reward(prompt, completion, **fields):\n    return 1.0\n"


def eval_sets(*sets) -> dict:
    return {"every_steps": 0, "prompts": 4, "sets": list(sets)}


def test_a_sets_team_dataset_and_function_resolve_to_the_stored_file_and_code(api_a, team_a, alice, dataset_a, spec):
    create_function(team_a, alice, "always", CODE)
    submitted = spec(eval=eval_sets(
        {"name": "mine", "dataset": "add@1", "prompt_field": "q", "reward": {"function": "always@1"}, "n": 4, "k": [1, 4]},
        {"name": "held", "n": 2},
        {"name": "gen", "dataset": "gen:chain", "n": 2}))
    response = api_a.post("/api/runs/", {"spec": submitted})
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["spec"] == submitted  # kept as submitted
    mine, held, gen = body["resolved_spec"]["eval"]["sets"]
    assert (mine["dataset"], mine["prompt_field"], mine["answer_field"]) == (str(dataset_a.path), "prompt", "answer")
    assert (mine["reward"]["function"], mine["reward"]["code"], mine["k"]) == ("user", CODE, [1, 4])
    assert held["dataset"] is None and held["reward"] is None  # the run's held-out split and reward
    assert gen["dataset"] == "gen:chain"


def test_a_set_pins_the_newest_versions_at_submission_and_dispatch_keeps_them(team_a, alice, dataset_a, spec):
    function = create_function(team_a, alice, "always", CODE).function
    run = submit_run(team_a, alice, spec(eval=eval_sets({"name": "mine", "dataset": "add",
                                                          "reward": {"function": "always"}})))
    generate_version(team_a, alice, "add", "add", n=40, seed=2)  # add@2, after the submission
    add_version(function, alice, CODE.replace("1.0", "0.5"))
    one = resolve_spec(run)["eval"]["sets"][0]
    assert one["dataset"] == str(dataset_a.path) and one["reward"]["code"] == CODE


def test_another_teams_dataset_is_refused_in_a_set(api_b, dataset_a, spec, assert_error):
    error = assert_error(api_b.post("/api/runs/", {"spec": spec(eval=eval_sets({"name": "theirs", "dataset": "add@1"}))}),
                         400, field="spec.eval.sets.0.dataset")
    assert "team-b" in error["message"]


def test_another_teams_reward_function_is_refused_in_a_set(api_b, team_a, alice, spec, assert_error):
    create_function(team_a, alice, "always", CODE)
    assert_error(api_b.post("/api/runs/", {"spec": spec(eval=eval_sets(
        {"name": "s", "reward": {"function": "always@1"}}))}), 400, field="spec.eval.sets.0.reward.function")


def test_a_file_path_on_the_worker_host_is_not_a_set_dataset(api_a, spec, assert_error):
    assert_error(api_a.post("/api/runs/", {"spec": spec(eval=eval_sets({"name": "s", "dataset": "/etc/passwd"}))}),
                 400, field="spec.eval.sets.0.dataset")


def test_k_above_n_is_refused_naming_the_field(api_a, spec, assert_error):
    error = assert_error(api_a.post("/api/runs/", {"spec": spec(eval=eval_sets({"name": "s", "n": 2, "k": [4]}))}),
                         400, field="spec.eval.sets.0.k")
    assert "1 <= k <= n" in error["fields"]["spec.eval.sets.0.k"]
