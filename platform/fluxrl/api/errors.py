"""One JSON shape for every API error:
{"error": {"code": "...", "message": "...", "fields": {"a.b": "..."}}}"""
from __future__ import annotations

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig
from django.http import Http404, JsonResponse
from django.views.defaults import page_not_found, server_error
from rest_framework import exceptions, serializers
from rest_framework.response import Response
from rest_framework.views import exception_handler

from fluxrl.errors import DomainError


def error_body(code: str, message: str, fields: dict | None = None) -> dict:
    return {"error": {"code": code, "message": message, "fields": fields or {}}}


def flatten_detail(detail, prefix: str = "") -> dict[str, str]:
    """DRF's nested ValidationError detail -> {"a.0.b": "first message"}."""
    if isinstance(detail, dict):
        out = {}
        for key, value in detail.items():
            name = prefix if key == "non_field_errors" and not prefix else f"{prefix}.{key}" if prefix else str(key)
            out.update(flatten_detail(value, name))
        return out
    if isinstance(detail, list):
        if all(not isinstance(item, (dict, list)) for item in detail):
            return {prefix or "(body)": "; ".join(str(item) for item in detail)} if detail else {}
        out = {}
        for index, item in enumerate(detail):
            out.update(flatten_detail(item, f"{prefix}.{index}" if prefix else str(index)))
        return out
    return {prefix or "(body)": str(detail)}


class PayloadTooLarge(exceptions.APIException):
    status_code = 413
    default_code = "too_large"
    default_detail = "The request body is too large."


def api_exception_handler(exc, context):
    if isinstance(exc, DomainError):
        response = Response(error_body(exc.code, exc.message, exc.fields), status=exc.status)
        if getattr(exc, "retry_after_s", None):
            response["Retry-After"] = str(exc.retry_after_s)
        return response
    if isinstance(exc, RecursionError):
        # Data nested deeper than some recursive step (parsing, validation, copying) can
        # follow is the client's input, not a server fault.
        message = "The request body is nested too deeply to process."
        return Response(error_body("invalid", message, {"body": message}), status=400)
    if isinstance(exc, RequestDataTooBig):
        exc = PayloadTooLarge(str(exc))
    elif isinstance(exc, Http404):
        exc = exceptions.NotFound(str(exc) or None)
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied(str(exc) or None)
    response = exception_handler(exc, context)  # sets WWW-Authenticate / Retry-After headers
    if response is None:
        return None
    if isinstance(exc, serializers.ValidationError):
        fields = flatten_detail(exc.detail)
        message = "; ".join(f"{k}: {v}" if k != "(body)" else v for k, v in fields.items()) or "Invalid input."
        response.data = error_body("invalid", message, {k: v for k, v in fields.items() if k != "(body)"})
    else:
        codes = exc.get_codes()
        # a body that does not parse (bad JSON/YAML, nested too deep) is the field at fault
        fields = {"body": str(exc.detail)} if isinstance(exc, exceptions.ParseError) else None
        response.data = error_body(codes if isinstance(codes, str) else exc.default_code, str(exc.detail), fields)
    return response


# Django-level handlers, so unknown /api/ URLs and crashes also answer in JSON.
def not_found(request, exception=None):
    if request.path.startswith("/api/"):
        return JsonResponse(error_body("not_found", f"No API endpoint at {request.path}"), status=404)
    return page_not_found(request, exception)


def crashed(request):
    if request.path.startswith("/api/"):
        return JsonResponse(error_body("server_error", "Internal server error."), status=500)
    return server_error(request)
