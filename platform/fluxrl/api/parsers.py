"""Parsers that refuse an oversized body before reading it (413). A view sets
`max_body_bytes`; otherwise Django's DATA_UPLOAD_MAX_MEMORY_SIZE applies."""
from io import BytesIO

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser, MultiPartParser

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


class LimitedJSONParser(JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        check_body_size(parser_context or {})
        raw = stream.read()
        data = super().parse(BytesIO(raw), media_type, parser_context)
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
