"""A run's walk from the REST POST to the spec file the engine loads validates the spec once
(at submission) and hands the engine a resolved document it builds without validating."""
import json

import pytest

from fluxrl.rewards.services import create_function
from fluxrl.runs.engine_inputs import resolve_spec
from fluxrl.runs.models import Run
from workers.spec import RunSpec, SpecError, load_spec_file, resolved_document

CODE = "def reward(prompt, completion, **fields):\n    return 1.0\n"


@pytest.fixture
def validations(monkeypatch):
    calls = []
    validate = RunSpec.model_validate

    def counted(cls, *args, **kwargs):
        calls.append(args[0] if args else kwargs)
        return validate(*args, **kwargs)

    monkeypatch.setattr(RunSpec, "model_validate", classmethod(counted))
    return calls


def test_the_walk_from_post_to_the_engines_spec_validates_once(api_a, team_a, alice, dataset_a, spec, tmp_path,
                                                                 validations):
    create_function(team_a, alice, "always", CODE)
    response = api_a.post("/api/runs/", {"spec": spec(task={"dataset": "add@1"}, reward={"function": "always@1"})})
    assert response.status_code == 201, response.content
    assert len(validations) == 1  # at submission, the mapping as submitted

    run = Run.objects.get(pk=response.json()["id"])
    assert run.resolved_spec["version"] == 1
    path = tmp_path / "spec.json"  # what dispatch writes (test_dispatch.py checks the file is this)
    path.write_text(json.dumps(resolved_document(resolve_spec(run))))
    loaded = load_spec_file(str(path))  # what the engine's CLI reads
    assert len(validations) == 1
    assert (loaded.task.dataset, loaded.reward.function, loaded.reward.code) == (str(dataset_a.path), "user", CODE)
    assert loaded.to_dict() == resolve_spec(run)


def test_a_stored_spec_of_another_version_reaches_the_engine_and_is_refused_there(run_a, tmp_path):
    Run.objects.filter(pk=run_a.pk).update(resolved_spec={**run_a.resolved_spec, "version": 0})
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(resolved_document(resolve_spec(Run.objects.get(pk=run_a.pk)))))
    with pytest.raises(SpecError, match="written for schema version 0; this FluxRL reads version 1 only"):
        load_spec_file(str(path))


def test_a_submitted_spec_of_another_version_is_a_400_on_the_field(api_a, spec):
    response = api_a.post("/api/runs/", {"spec": {**spec(), "version": 3}})
    assert response.status_code == 400
    assert "newer than the 1 this FluxRL reads" in response.json()["error"]["fields"]["spec.version"]


def test_the_migration_stamps_a_stored_spec_that_validates_as_version_1_and_leaves_the_rest(run_a):
    import importlib

    from django.apps import apps

    migration = importlib.import_module("fluxrl.runs.migrations.0008_resolved_spec_version")
    unstamped = {k: v for k, v in run_a.resolved_spec.items() if k != "version"}
    broken = {**unstamped, "rollout": {**unstamped["rollout"], "no_such_field": 1}}
    old = Run.objects.create(team=run_a.team, owner=run_a.owner, name="old", spec=run_a.spec, resolved_spec=unstamped)
    odd = Run.objects.create(team=run_a.team, owner=run_a.owner, name="odd", spec=run_a.spec, resolved_spec=broken)
    migration.stamp_version_1(apps, None)
    assert Run.objects.get(pk=old.pk).resolved_spec == {**unstamped, "version": 1}
    assert Run.objects.get(pk=odd.pk).resolved_spec == broken  # refused by the engine, with the reason
    assert Run.objects.get(pk=run_a.pk).resolved_spec == run_a.resolved_spec
