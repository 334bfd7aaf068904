"""A resolved spec: the document the platform hands an engine after it validated the submitted
spec once and replaced the team's references with files, code and folders.

The engine builds its RunSpec from it without validating again (``construct``: the sections
and their nested models are built from the stored values as they are). What it does check is
where the document comes from and which schema it was written for: a spec of another version
is refused with the reason, never read field by field under rules it was not written for.

A YAML or JSON spec that is not such a document (the CLI's own files) is validated as usual
(loading.py)."""
from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel

from workers.spec.base import SpecError, version_refusal
from workers.spec.run import RunSpec

RESOLVED_KIND = "fluxrl.resolved-spec"


def resolved_document(spec: dict[str, Any]) -> dict[str, Any]:
    """The document the platform writes for an engine: a validated, resolved spec (a
    ``RunSpec.to_dict()`` with references replaced), marked as such."""
    return {"kind": RESOLVED_KIND, "spec": spec}


def is_resolved_document(data: Any) -> bool:
    return isinstance(data, dict) and data.get("kind") == RESOLVED_KIND


def load_resolved(document: dict[str, Any]) -> RunSpec:
    """The RunSpec in a resolved document, built without validation, or SpecError naming why
    the document cannot run here (its shape or its schema version)."""
    spec = document.get("spec")
    if not isinstance(spec, dict):
        raise SpecError([{"field": "(document)", "message": "a resolved spec document holds a mapping under 'spec'"}])
    refusal = version_refusal(spec.get("version"))
    if refusal is not None:
        raise SpecError([{"field": "version", "message": refusal}])
    return construct(RunSpec, spec)


# -- building models without validation ---------------------------------------------------------
def construct(cls: type[BaseModel], data: dict[str, Any], where: str = "") -> Any:
    """``cls`` built from ``data`` without validation, nested models included (pydantic's
    ``model_construct`` leaves nested sections as dicts). The document must have the shape
    of the schema version it states: a key ``cls`` does not declare, or a required one
    missing, is a SpecError naming it (a newer platform's field must not be dropped in
    silence)."""
    unknown = [k for k in data if k not in cls.model_fields]
    missing = [n for n, f in cls.model_fields.items() if f.is_required() and n not in data]
    if unknown or missing:
        raise SpecError([{"field": where + k, "message": "unknown field in a resolved spec of this version"}
                         for k in unknown] + [{"field": where + n, "message": "missing from a resolved spec"}
                                              for n in missing])
    values = {name: _value(cls.model_fields[name].annotation, data[name], f"{where}{name}.") for name in data}
    return cls.model_construct(_fields_set=set(values), **values)


def _value(annotation: Any, value: Any, where: str) -> Any:
    if value is None:
        return None
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        models = [a for a in get_args(annotation) if a is not type(None)]
        # Optional[X]: X; a union of several kinds stays as stored (the spec has none of models)
        return _value(models[0], value, where) if len(models) == 1 else value
    if origin is list and isinstance(value, list):
        (item,) = get_args(annotation)
        return [_value(item, v, f"{where}{i}.") for i, v in enumerate(value)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel) and isinstance(value, dict):
        return construct(annotation, value, where)
    return value
