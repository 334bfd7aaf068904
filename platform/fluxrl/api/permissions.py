from rest_framework.permissions import SAFE_METHODS, BasePermission

from fluxrl.accounts.models import ApiToken, RunToken


def token_scope_error(request) -> str | None:
    """Why an API token may not make this request (read for safe methods, else write)."""
    needed = "read" if request.method in SAFE_METHODS else "write"
    if isinstance(request.auth, ApiToken) and needed not in request.auth.scopes:
        return f"This token lacks the '{needed}' scope."
    return None


class IsTeamUser(BasePermission):
    """The default: a signed-in person (session or API token with the needed scope).
    Run tokens are refused here; they only pass RunWorkerOrTeamUser."""

    message = "Run tokens may only report to their own run."

    def has_permission(self, request, view):
        if not (request.user and request.user.is_authenticated) or isinstance(request.auth, RunToken):
            return False
        error = token_scope_error(request)
        if error:
            self.message = error
        return error is None


class RunWorkerOrTeamUser(IsTeamUser):
    """Worker endpoints under /api/runs/<pk>/: the run's own token, or a team user."""

    def has_permission(self, request, view):
        if isinstance(request.auth, RunToken):
            self.message = "This run token belongs to another run."
            return str(request.auth.run_id) == str(view.kwargs.get("pk"))
        return super().has_permission(request, view)
