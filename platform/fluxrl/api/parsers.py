"""Parsers that refuse an oversized body before reading it (413). A view sets
`max_body_bytes`; otherwise Django's DATA_UPLOAD_MAX_MEMORY_SIZE applies."""
import math
from io import BytesIO

import yaml
from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser, JSONParser, MultiPartParser

from fluxrl.api.errors import PayloadTooLarge
from fluxrl.validation import contains_nul


def check_body_size(parser_context) -> None:
    request, view = parser_context.get("request"), parser_context.get("view")
    limit = getattr(view, "max_body_bytes", None) or settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    if length > limit:
        raise PayloadTooLarge(f"The request body is {length} bytes; the limit here is {limit} bytes.")


MAX_JSON_DEPTH = 100  # as for YAML: deeper data would hit Python's recursion limit further on (500s)


def nesting_depth(value, limit: int) -> int:
    """How deep lists and dicts nest in value, without recursion, stopping past limit
    (~1 ms for a 1000-point metrics batch: only containers are stacked)."""
    if not isinstance(value, (dict, list)):
        return 0
    deepest, stack = 1, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if depth > limit:
                break
        for child in (item.values() if isinstance(item, dict) else item):
            if type(child) is dict or type(child) is list:  # noqa: E721 - exact JSON types, fast
                stack.append((child, depth + 1))
    return deepest


class LimitedJSONParser(JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        check_body_size(parser_context or {})
        raw = stream.read()
        try:
            data = super().parse(BytesIO(raw), media_type, parser_context)
        except RecursionError:  # the C decoder recurses per level (~1000 levels)
            raise ParseError(f"The JSON body is nested more than {MAX_JSON_DEPTH} levels deep.") from None
        # Openers bound the depth: count them (fast, in C) before walking the data.
        if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and nesting_depth(data, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            raise ParseError(f"The JSON body is nested more than {MAX_JSON_DEPTH} levels deep.")
        # UTF-8 JSON can only spell NUL as \u0000: without one in the body, skip the walk
        # over every string (it costs more than parsing a 1000-point metrics batch).
        utf8 = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET).lower().replace("_", "-") == "utf-8"
        if (b"\\u0000" in raw or not utf8) and contains_nul(data):
            raise ParseError("JSON strings must not contain NUL (\\u0000) characters.")
        return data


class LimitedMultiPartParser(MultiPartParser):
    def parse(self, stream, media_type=None, parser_context=None):
        check_body_size(parser_context or {})
        return super().parse(stream, media_type, parser_context)


MAX_YAML_DEPTH = 100  # safe_load's composer recurses per level (~500 levels hit Python's limit); specs use ~3


def check_json_like(value, path: str = "") -> None:
    """Only what a JSON body could hold, so YAML reaches the serializers as JSON would:
    YAML alone has dates, bytes, sets, non-string keys and .nan/.inf; and no NUL (PostgreSQL)."""
    where = f" at {path}" if path else ""
    if isinstance(value, str):
        if "\x00" in value:
            raise ParseError(f"YAML strings must not contain NUL characters{where}.")
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ParseError(f"YAML mapping keys must be strings; quote {key!r}{where}.")
            check_json_like(key, path)
            check_json_like(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_json_like(item, f"{path}.{index}" if path else str(index))
    elif isinstance(value, float) and not math.isfinite(value):
        raise ParseError(f"YAML .nan/.inf are not allowed (JSON has none){where}.")
    elif value is not None and not isinstance(value, (bool, int, float)):
        raise ParseError(f"YAML {type(value).__name__} values are not allowed{where}; quote it to make it a string.")


def load_yaml_mapping(text: str) -> dict:
    """A YAML document holding one mapping (a run spec), as JSON could hold it, or a
    ParseError. Anchors/aliases are refused before loading: safe_load shares aliased nodes,
    but a spec is deep-copied and stored as JSON, so `*a` nested 9 deep would expand a
    billion-fold."""
    if "\x00" in text:
        raise ParseError("The YAML must not contain NUL characters.")
    try:
        depth = 0
        for event in yaml.parse(text, Loader=yaml.SafeLoader):  # events only: cheap, builds nothing
            if getattr(event, "anchor", None) is not None:
                raise ParseError(f"YAML anchors and aliases are not allowed (line {event.start_mark.line + 1}).")
            depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
            if depth > MAX_YAML_DEPTH:
                raise ParseError(f"The YAML is nested more than {MAX_YAML_DEPTH} levels deep.")
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ParseError(f"YAML syntax error{where}: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ParseError(f"Invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        found = "an empty document" if data is None else f"a {type(data).__name__}"
        raise ParseError(f"The run spec must be a YAML mapping, not {found}.")
    check_json_like(data)
    return data


class LimitedYAMLParser(BaseParser):
    """A YAML body holding one mapping (a run spec), with the JSON parser's size limit
    (load_yaml_mapping: no anchors or aliases)."""

    media_type = "application/yaml"

    def parse(self, stream, media_type=None, parser_context=None):
        check_body_size(parser_context or {})
        raw = stream.read()
        if b"\x00" in raw:
            raise ParseError("The YAML body must not contain NUL bytes.")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ParseError(f"The YAML body is not valid UTF-8 (byte {exc.start}).") from None
        return load_yaml_mapping(text)


# DRF picks a parser by its one media_type: one class per YAML media type.
class LimitedXYAMLParser(LimitedYAMLParser):
    media_type = "application/x-yaml"


class LimitedTextYAMLParser(LimitedYAMLParser):
    media_type = "text/yaml"


YAML_PARSERS = [LimitedYAMLParser, LimitedXYAMLParser, LimitedTextYAMLParser]
YAML_MEDIA_TYPES = tuple(parser.media_type for parser in YAML_PARSERS)
