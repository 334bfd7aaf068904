"""A spec's model.path is scoped: built-in names, folders under the configured model
roots, and the team's own run outputs. Nothing else on the worker host."""
import os

import pytest

from fluxrl.errors import InvalidInput
from fluxrl.runs import dispatch
from fluxrl.runs.models import Run, RunStatus
from fluxrl.runs.engine_inputs import check_model_path, engine_spec, resolve_spec, run_output_dir
from fluxrl.runs.services import submit_run


@pytest.fixture
def roots(tmp_path, monkeypatch):
    shared = tmp_path / "shared-models"
    (shared / "qwen").mkdir(parents=True)
    monkeypatch.setenv("FLUXRL_MODEL_ROOTS", str(shared))
    return shared


def post(api, spec, path):
    return api.post("/api/runs/", {"spec": spec(model={"path": str(path)})})


def refused(response) -> str:
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert "spec.model.path" in error["fields"], error
    return error["message"]


def test_builtin_names_and_folders_under_a_model_root_are_accepted(api_a, spec, roots):
    assert api_a.post("/api/runs/", {"spec": spec()}).status_code == 201  # builtin:tiny
    assert post(api_a, spec, roots / "qwen").status_code == 201


@pytest.mark.parametrize("path", ["/etc", "/", "relative/model", "../models/qwen", "./qwen", "qwen/../../elsewhere",
                                  "builtin:huge", "Qwen/Qwen2-0.5B"])
def test_paths_outside_the_roots_are_refused_naming_the_field(api_a, spec, roots, path):
    refused(post(api_a, spec, path))


def test_dot_dot_out_of_a_root_is_refused(api_a, spec, roots):
    refused(post(api_a, spec, f"{roots}/../../"))


def test_a_symlink_inside_a_root_pointing_outside_is_refused(api_a, spec, roots, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.symlink(outside, roots / "sneaky")
    refused(post(api_a, spec, roots / "sneaky"))


def test_own_run_outputs_are_accepted_and_another_teams_refused(api_a, spec, team_a, team_b, alice, carol, settings, roots):
    mine = submit_run(team_a, alice, spec())
    theirs = submit_run(team_b, carol, spec())
    runs = settings.FLUXRL_DATA_DIR / "runs"  # the dispatcher's run folders: <id>/out
    for run in (mine, theirs):
        (runs / str(run.pk) / "out" / "final_model").mkdir(parents=True)
    assert post(api_a, spec, runs / str(mine.pk) / "out" / "final_model").status_code == 201
    message = refused(post(api_a, spec, runs / str(theirs.pk) / "out" / "final_model"))
    assert "not allowed" in message
    refused(post(api_a, spec, runs / str(mine.pk) / "engine.log"))  # a run folder, not its outputs


def test_a_path_no_longer_allowed_at_dispatch_fails_the_run_without_starting_it(team_a, alice, spec, roots, tmp_path):
    target = roots / "qwen"
    run = submit_run(team_a, alice, spec(model={"path": str(target)}))
    target.rmdir()
    os.symlink(tmp_path, target)  # swapped for a link out after submission
    assert dispatch.execute_run(run.pk) == "failed"
    run = Run.objects.get(pk=run.pk)
    assert run.status == RunStatus.FAILED and "spec.model.path" in run.failure_reason
    assert not (dispatch.run_dir(run.pk) / "spec.json").exists()  # no engine was given the spec


def test_the_default_root_is_the_models_folder_of_the_data_dir(api_a, spec, settings, monkeypatch):
    monkeypatch.delenv("FLUXRL_MODEL_ROOTS", raising=False)
    (settings.FLUXRL_DATA_DIR / "models" / "m").mkdir(parents=True)
    assert post(api_a, spec, settings.FLUXRL_DATA_DIR / "models" / "m").status_code == 201
    refused(post(api_a, spec, settings.FLUXRL_DATA_DIR / "elsewhere"))


def test_several_roots_are_separated_by_os_pathsep(api_a, spec, tmp_path, monkeypatch):
    first, second = tmp_path / "r1", tmp_path / "r2"
    (second / "m").mkdir(parents=True)
    first.mkdir()
    monkeypatch.setenv("FLUXRL_MODEL_ROOTS", os.pathsep.join([str(first), str(second)]))
    assert post(api_a, spec, second / "m").status_code == 201


def test_a_hub_id_is_accepted_only_where_that_folder_exists_under_a_root(api_a, spec, roots):
    message = refused(post(api_a, spec, "Qwen/Qwen2-0.5B"))
    assert "do not download" in message and str(roots) in message
    (roots / "Qwen" / "Qwen2-0.5B").mkdir(parents=True)
    response = post(api_a, spec, "Qwen/Qwen2-0.5B")
    assert response.status_code == 201, response.content
    run = Run.objects.get(pk=response.json()["id"])
    assert run.spec["model"]["path"] == "Qwen/Qwen2-0.5B"  # as submitted
    assert run.resolved_spec["model"]["path"] == str(roots.resolve() / "Qwen" / "Qwen2-0.5B")  # what a worker loads


def test_a_link_from_the_teams_outputs_into_another_teams_is_refused(api_a, spec, team_a, team_b, alice, carol):
    mine, theirs = submit_run(team_a, alice, spec()), submit_run(team_b, carol, spec())
    (run_output_dir(theirs.pk) / "final_model").mkdir(parents=True)
    run_output_dir(mine.pk).mkdir(parents=True)
    os.symlink(run_output_dir(theirs.pk) / "final_model", run_output_dir(mine.pk) / "borrowed")
    refused(post(api_a, spec, run_output_dir(mine.pk) / "borrowed"))
    with pytest.raises(InvalidInput) as error:  # the service itself, as dispatch calls it
        check_model_path(team_b, str(run_output_dir(mine.pk)))
    assert "spec.model.path" in error.value.fields


def test_a_nul_in_a_stored_path_is_refused_not_a_crash(team_a, roots):
    with pytest.raises(InvalidInput, match="spec.model.path"):  # the API's JSON parser refuses it earlier
        check_model_path(team_a, f"{roots}/qwen\x00")


def test_the_engine_is_given_the_resolved_folder(team_a, alice, spec, roots):
    os.symlink(roots / "qwen", roots / "alias")
    run = submit_run(team_a, alice, spec(model={"path": f"{roots}/alias/../qwen"}))
    assert resolve_spec(run)["model"]["path"] == str((roots / "qwen").resolve())
    assert resolve_spec(submit_run(team_a, alice, spec()))["model"]["path"] == "builtin:tiny"


def test_a_spec_stored_before_the_rule_is_refused_at_dispatch(team_a, alice, spec, roots):
    stored = spec(model={"path": "/etc"})
    run = Run.objects.create(team=team_a, owner=alice, name="old", spec=stored, resolved_spec=engine_spec(stored))
    assert dispatch.execute_run(run.pk) == "failed"
    run.refresh_from_db()
    assert "spec.model.path" in run.failure_reason and not (dispatch.run_dir(run.pk) / "spec.json").exists()


def reward_model_spec(spec, path):
    return spec(reward={"components": [{"function": "model"}, {"function": "numeric_match", "weight": 0}],
                        "model": {"path": str(path)}})


@pytest.mark.parametrize("path", ["/etc", "builtin:tiny", "../models/qwen", "Qwen/Qwen2-0.5B-RM"])
def test_a_reward_model_path_is_scoped_like_the_model_path_and_named_in_the_refusal(api_a, spec, roots, path):
    response = api_a.post("/api/runs/", {"spec": reward_model_spec(spec, path)})
    assert response.status_code == 400, response.content
    assert "spec.reward.model.path" in response.json()["error"]["fields"], response.json()


def test_the_builtin_reward_model_and_one_under_a_root_reach_the_engine_spec_resolved(api_a, spec, roots, team_a):
    assert api_a.post("/api/runs/", {"spec": reward_model_spec(spec, "builtin:tiny-rm")}).status_code == 201
    os.symlink(roots / "qwen", roots / "rm-link")  # inside the root: resolved to the folder it names
    response = api_a.post("/api/runs/", {"spec": reward_model_spec(spec, roots / "rm-link")})
    assert response.status_code == 201, response.content
    run = Run.objects.get(pk=response.json()["id"])
    assert run.spec["reward"]["model"]["path"] == str(roots / "rm-link")  # as submitted
    assert resolve_spec(run)["reward"]["model"]["path"] == str(roots / "qwen")


def test_a_run_may_start_from_its_teams_adapter_and_never_from_another_teams(api_a, spec, team_a, team_b, alice,
                                                                             carol, settings, roots):
    """model.lora.init is scoped as model.path is: a LoRA run starts from an adapter of the
    team's own runs; another team's is refused naming the field, before anything is stored."""
    mine, theirs = submit_run(team_a, alice, spec()), submit_run(team_b, carol, spec())
    for run in (mine, theirs):
        (run_output_dir(run.pk) / "final_model" / "adapter").mkdir(parents=True)

    def lora(path):
        return spec(model={"path": "builtin:tiny", "lora": {"rank": 8, "init": str(path)}})

    ok = api_a.post("/api/runs/", {"spec": lora(run_output_dir(mine.pk) / "final_model" / "adapter")}, format="json")
    assert ok.status_code == 201, ok.content
    run = Run.objects.get(pk=ok.json()["id"])
    expected = os.path.realpath(run_output_dir(mine.pk) / "final_model" / "adapter")
    assert run.resolved_spec["model"]["lora"]["init"] == expected
    assert resolve_spec(run)["model"]["lora"]["init"] == expected
    before = Run.objects.count()
    bad = api_a.post("/api/runs/", {"spec": lora(run_output_dir(theirs.pk) / "final_model" / "adapter")},
                     format="json")
    assert bad.status_code == 400 and "spec.model.lora.init" in bad.json()["error"]["fields"]
    assert Run.objects.count() == before
