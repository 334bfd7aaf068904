"""A spec's model.path is scoped: built-in names, folders under the configured model
roots, and the team's own run outputs. Nothing else on the worker host."""
import os

import pytest

from fluxrl.runs import dispatch
from fluxrl.runs.models import Run, RunStatus
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


@pytest.mark.parametrize("path", ["/etc", "/", "relative/model", "../models/qwen", "builtin:huge", "Qwen/Qwen2-0.5B"])
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
