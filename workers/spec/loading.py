"""A run spec from a mapping, YAML/JSON text or a file, or a SpecError naming each field."""
from __future__ import annotations

import json
from typing import Any

import yaml
from pydantic import ValidationError

from workers.spec.base import SpecError
from workers.spec.run import RunSpec


def validate_spec(data: Any) -> RunSpec:
    """Validate a dict (or YAML/JSON text) into a RunSpec, or raise SpecError naming fields."""
    if isinstance(data, (str, bytes)):
        try:
            data = yaml.safe_load(data)
        except yaml.YAMLError as exc:
            raise SpecError([{"field": "(document)", "message": f"not valid YAML/JSON: {exc}"}]) from None
    if not isinstance(data, dict):
        raise SpecError([{"field": "(document)", "message": "a run spec must be a mapping"}])
    try:
        return RunSpec.model_validate(data)
    except ValidationError as exc:
        errors = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "(document)"
            msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
            errors.append({"field": field, "message": msg})
        raise SpecError(errors) from None


def load_spec_file(path: str) -> RunSpec:
    """The run spec in a YAML or JSON file: a resolved document from the platform, built as it
    was validated there (resolved.py; its schema version checked), else validated here
    (SpecError names the fields)."""
    from workers.spec.resolved import is_resolved_document, load_resolved

    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        data = json.loads(text)
    except ValueError:  # YAML (or broken JSON: validate_spec's YAML reading names it)
        return validate_spec(text)
    return load_resolved(data) if is_resolved_document(data) else validate_spec(data)
