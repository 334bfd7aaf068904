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


class TooManyRequests(DomainError):
    status, code = 429, "too_many_requests"

    def __init__(self, message: str, *, retry_after_s: int = 5):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def field_error(field: str, message: str) -> InvalidInput:
    """A 400 about one input field; the message names the field."""
    return InvalidInput(f"{field}: {message}", fields={field: message})
