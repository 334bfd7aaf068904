"""Domain errors raised by the services. They know nothing of HTTP beyond the status
they map to; fluxrl.api.errors turns them into the API's JSON error body."""
from __future__ import annotations


class DomainError(Exception):
    status = 400
    code = "invalid"

    def __init__(self, message: str, *, fields: dict[str, str] | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.fields = fields or {}
        if code:
            self.code = code


class InvalidInput(DomainError):
    pass


class Unauthorized(DomainError):
    status, code = 401, "not_authenticated"


class Forbidden(DomainError):
    status, code = 403, "permission_denied"


class NotFound(DomainError):
    status, code = 404, "not_found"


class Conflict(DomainError):
    status, code = 409, "conflict"


class TooLarge(DomainError):
    status, code = 413, "too_large"


def field_error(field: str, message: str) -> InvalidInput:
    """A 400 about one input field; the message names the field."""
    return InvalidInput(f"{field}: {message}", fields={field: message})
