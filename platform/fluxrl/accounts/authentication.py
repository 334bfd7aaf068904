from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed

from .services import KeyRefused, check_key


class BearerTokenAuthentication(BaseAuthentication):
    """`Authorization: Bearer <key>` with a user API token or a run token."""

    def authenticate(self, request):
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != b"bearer":
            return None
        if len(parts) != 2:
            raise AuthenticationFailed("Malformed Authorization header; expected 'Bearer <key>'.")
        try:
            return check_key(parts[1].decode("latin-1"))
        except KeyRefused as exc:
            raise AuthenticationFailed(str(exc)) from None

    def authenticate_header(self, request):
        return 'Bearer realm="api"'  # makes DRF answer 401 (not 403) when no credentials


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = BearerTokenAuthentication
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer",
                "description": "a user API token (flxu_…) or, on worker endpoints, a run token (flxr_…)"}
