"""Parsers that refuse an oversized body before reading it (413). A view sets
`max_body_bytes`; otherwise Django's DATA_UPLOAD_MAX_MEMORY_SIZE applies."""
from io import BytesIO

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser, JSONParser, MultiPartParser

from fluxrl.api.errors import PayloadTooLarge
from fluxrl.safe_yaml import BadYAML, load_yaml_mapping
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


class LimitedYAMLParser(BaseParser):
    """A YAML body holding one mapping (a run spec), with the JSON parser's size limit
    (fluxrl.safe_yaml.load_yaml_mapping: no anchors or aliases)."""

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
        try:
            return load_yaml_mapping(text)
        except BadYAML as exc:
            raise ParseError(str(exc)) from None


# DRF picks a parser by its one media_type: one class per YAML media type.
class LimitedXYAMLParser(LimitedYAMLParser):
    media_type = "application/x-yaml"


class LimitedTextYAMLParser(LimitedYAMLParser):
    media_type = "text/yaml"


YAML_PARSERS = [LimitedYAMLParser, LimitedXYAMLParser, LimitedTextYAMLParser]
YAML_MEDIA_TYPES = tuple(parser.media_type for parser in YAML_PARSERS)
