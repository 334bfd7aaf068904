"""The resolved spec document: built without validation, exactly as validated, and refused
when it was written for another schema version."""
import json
from pathlib import Path

import pytest

from workers.spec import (SPEC_VERSION, LoraSpec, RewardComponent, RunSpec, SpecError, TensorBoardReport,
                          load_resolved, load_spec_file, resolved_document, validate_spec)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))

# every kind of nested section: optional models, lists of models, optional lists of models
NESTED = {
    "name": "nested",
    "model": {"path": "builtin:tiny", "lora": {"rank": 8, "alpha": 16}},
    "task": {"dataset": "gen:add", "environment": {"name": "tools", "tools": ["calculator"], "max_turns": 2}},
    "reward": {"components": [{"function": "numeric_match", "weight": 0.5}, {"function": "exact_match", "weight": 0.5}]},
    "eval": {"sets": [{"name": "more", "dataset": "gen:add", "reward": {"function": "numeric_match"}}]},
    "report": {"tensorboard": {}},
}


def never_validated(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a resolved spec was validated again")
    monkeypatch.setattr(RunSpec, "model_validate", classmethod(refuse))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_an_example_resolved_loads_equal_to_its_validation_without_validating(path, monkeypatch):
    validated = validate_spec(path.read_text())
    document = json.loads(json.dumps(resolved_document(validated.to_dict())))
    never_validated(monkeypatch)
    loaded = load_resolved(document)
    assert loaded == validated
    assert loaded.to_dict() == validated.to_dict()


def test_nested_sections_are_built_as_their_models(monkeypatch):
    validated = validate_spec(NESTED)
    never_validated(monkeypatch)
    loaded = load_resolved(resolved_document(validated.to_dict()))
    assert loaded == validated
    assert isinstance(loaded.model.lora, LoraSpec)
    assert all(isinstance(c, RewardComponent) for c in loaded.reward.components)
    assert isinstance(loaded.report.tensorboard, TensorBoardReport)
    assert loaded.eval.sets[0].reward.function == "numeric_match"
    assert loaded.task.environment.tools == ["calculator"]
    assert loaded.model.lora.rank == 8 and loaded.algorithm.minibatches == validated.algorithm.minibatches


def test_a_loaded_resolved_spec_still_checks_an_assignment():
    loaded = load_resolved(resolved_document(validate_spec(NESTED).to_dict()))
    loaded.model.path = "/models/qwen"  # what the Controller does once it resolved the folder
    assert loaded.model.path == "/models/qwen"
    with pytest.raises(ValueError):
        loaded.rollout.max_tokens = -1


def _refusal(version) -> str:
    spec = {**validate_spec(NESTED).to_dict(), "version": version}
    if version is None:
        del spec["version"]
    with pytest.raises(SpecError) as err:
        load_resolved(resolved_document(spec))
    assert [e["field"] for e in err.value.errors] == ["version"]
    return err.value.errors[0]["message"]


def test_a_resolved_spec_of_another_schema_version_is_refused_with_the_reason():
    assert SPEC_VERSION == 1
    assert _refusal(2) == ("the spec was written for schema version 2, newer than the 1 this FluxRL reads: "
                           "upgrade FluxRL (the platform and the workers)")
    assert _refusal(0) == ("the spec was written for schema version 0; this FluxRL reads version 1 only: "
                           "submit it again under this version")
    assert _refusal(None).startswith("the spec names no schema version; this FluxRL reads version 1 only")
    assert "'1'" in _refusal("1") and "version 1 only" in _refusal(True)


def test_a_user_spec_states_its_version_or_gets_this_one():
    assert validate_spec(NESTED).version == 1
    assert validate_spec({**NESTED, "version": 1}).to_dict()["version"] == 1
    with pytest.raises(SpecError) as err:
        validate_spec({**NESTED, "version": 2})
    assert err.value.errors[0]["field"] == "version"
    assert "newer than the 1 this FluxRL reads" in err.value.errors[0]["message"]


def test_a_document_without_a_mapping_is_refused():
    with pytest.raises(SpecError, match="holds a mapping under 'spec'"):
        load_resolved({"kind": "fluxrl.resolved-spec", "spec": ["name"]})


def test_a_spec_file_is_validated_unless_it_is_a_resolved_document(tmp_path, monkeypatch):
    user = tmp_path / "spec.yaml"
    user.write_text("name: x\nmodel: {path: builtin:tiny}\ntask: {dataset: gen:add}\nrollout: {max_tokens: -3}\n")
    with pytest.raises(SpecError, match="rollout.max_tokens"):
        load_spec_file(str(user))  # the CLI's own file: validated
    resolved = tmp_path / "spec.json"
    resolved.write_text(json.dumps(resolved_document(validate_spec(NESTED).to_dict())))
    never_validated(monkeypatch)
    assert load_spec_file(str(resolved)).name == "nested"


def test_a_resolved_document_with_a_field_this_version_lacks_or_a_missing_section_is_refused_by_name():
    spec = validate_spec(NESTED).to_dict()
    spec["rollout"]["speculative"] = True  # a field a newer platform knows and this engine would drop
    spec["eval"]["sets"][0]["reward"]["bonus"] = 1
    del spec["task"]
    with pytest.raises(SpecError) as err:
        load_resolved(resolved_document(spec))
    assert {e["field"]: e["message"] for e in err.value.errors} == {
        "task": "missing from a resolved spec"}  # the first level's problems first
    spec["task"] = validate_spec(NESTED).to_dict()["task"]
    with pytest.raises(SpecError) as err:
        load_resolved(resolved_document(spec))
    assert [e["field"] for e in err.value.errors] == ["rollout.speculative"]
