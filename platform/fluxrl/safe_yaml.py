"""The one checked YAML loader for run specs, in the API's YAML bodies (fluxrl.api.parsers)
and in spec text given to a service (runs.services.load_spec_text): one mapping, as JSON
could hold it; no anchors or aliases, bounded depth. No Django or DRF here: each caller
turns BadYAML into its own error (a 400 parse error, or a 400 naming the field)."""
from __future__ import annotations

import math

import yaml


class BadYAML(ValueError):
    """Text that is not a YAML mapping a run spec may be; the message says why."""


MAX_YAML_DEPTH = 100  # safe_load's composer recurses per level (~500 levels hit Python's limit); specs use ~3


def check_json_like(value, path: str = "") -> None:
    """Only what a JSON body could hold, so YAML reaches the serializers as JSON would:
    YAML alone has dates, bytes, sets, non-string keys and .nan/.inf; and no NUL (PostgreSQL)."""
    where = f" at {path}" if path else ""
    if isinstance(value, str):
        if "\x00" in value:
            raise BadYAML(f"YAML strings must not contain NUL characters{where}.")
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise BadYAML(f"YAML mapping keys must be strings; quote {key!r}{where}.")
            check_json_like(key, path)
            check_json_like(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_json_like(item, f"{path}.{index}" if path else str(index))
    elif isinstance(value, float) and not math.isfinite(value):
        raise BadYAML(f"YAML .nan/.inf are not allowed (JSON has none){where}.")
    elif value is not None and not isinstance(value, (bool, int, float)):
        raise BadYAML(f"YAML {type(value).__name__} values are not allowed{where}; quote it to make it a string.")


def load_yaml_mapping(text: str) -> dict:
    """A YAML document holding one mapping (a run spec), as JSON could hold it, or a
    BadYAML. Anchors/aliases are refused before loading: safe_load shares aliased nodes,
    but a spec is deep-copied and stored as JSON, so `*a` nested 9 deep would expand a
    billion-fold."""
    if "\x00" in text:
        raise BadYAML("The YAML must not contain NUL characters.")
    try:
        depth = 0
        for event in yaml.parse(text, Loader=yaml.SafeLoader):  # events only: cheap, builds nothing
            if getattr(event, "anchor", None) is not None:
                raise BadYAML(f"YAML anchors and aliases are not allowed (line {event.start_mark.line + 1}).")
            depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
            if depth > MAX_YAML_DEPTH:
                raise BadYAML(f"The YAML is nested more than {MAX_YAML_DEPTH} levels deep.")
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise BadYAML(f"YAML syntax error{where}: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise BadYAML(f"Invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        found = "an empty document" if data is None else f"a {type(data).__name__}"
        raise BadYAML(f"The run spec must be a YAML mapping, not {found}.")
    check_json_like(data)
    return data
