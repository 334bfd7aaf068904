"""ASGI entry (daphne fluxrl.asgi:application): HTTP goes to Django, websockets to
the routes in fluxrl/routing.py."""
import json
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fluxrl.settings")
# Under ASGI each request's sync code runs in a thread of its own, so a persistent
# connection would be left behind by every request until PostgreSQL refuses more
# clients ("too many clients", seen under bench/ingest.py). On PostgreSQL a pool
# (settings.py) hands each request a connection and takes it back at the end; without
# one (FLUXRL_DB_POOL=0), connect per request.
os.environ.setdefault("DATABASE_CONN_MAX_AGE", "0")
os.environ.setdefault("FLUXRL_DB_POOL", "1")
django_asgi_app = get_asgi_application()  # sets Django up before the imports below

from channels.auth import AuthMiddlewareStack  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from fluxrl.accounts.websocket_auth import TokenAuthMiddleware  # noqa: E402
from fluxrl.routing import websocket_urlpatterns  # noqa: E402


class BodyLimit:
    """HTTP request bodies above max_bytes answer 413 before Django reads them (Django would
    spool them to disk, and parse them before any view looks at the size): at once when
    Content-Length says so, and a chunked body once it goes past the limit (Django is told
    the client left). The server itself has already received the body by then (daphne
    buffers it): a proxy's body limit stops it earlier still. Websockets pass untouched.
    ``larger``: paths whose POST may carry more (a model folder's archive)."""

    def __init__(self, app, max_bytes: int, larger: dict[str, int] | None = None):
        self.app, self.default_bytes, self.larger = app, max_bytes, larger or {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        max_bytes = self.larger.get(scope.get("path", ""), self.default_bytes) if scope.get("method") == "POST" \
            else self.default_bytes
        declared = next((value for name, value in scope.get("headers", ()) if name.lower() == b"content-length"), b"")
        if declared.strip().isdigit() and int(declared) > max_bytes:
            return await self.refuse(send, max_bytes)
        received, over, started = 0, False, False

        async def limited_receive():
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    over = True
                    return {"type": "http.disconnect"}  # Django stops reading and answers nothing
            return message

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, limited_receive, watched_send)
        if over and not started:
            await self.refuse(send, max_bytes)

    async def refuse(self, send, max_bytes: int):
        setting = "FLUXRL_MAX_BODY_MB" if max_bytes == self.default_bytes else "FLUXRL_MAX_MODEL_MB"
        body = json.dumps({"error": {"code": "too_large", "message": f"The request body is over the server's limit "
                                     f"of {max_bytes} bytes ({setting}).", "fields": {}}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


# Static files (admin, API docs, dashboard) straight from the app folders: no
# collectstatic or extra server needed at this scale; FLUXRL_SERVE_STATIC=0 to leave it to a proxy.
http_app = ASGIStaticFilesHandler(django_asgi_app) if settings.FLUXRL_SERVE_STATIC else django_asgi_app

application = ProtocolTypeRouter(
    {
        "http": BodyLimit(http_app, settings.FLUXRL_MAX_BODY_BYTES,
                          larger={"/api/models/": settings.FLUXRL_MAX_MODEL_BYTES + 2**20}),  # + the form fields
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(TokenAuthMiddleware(URLRouter(websocket_urlpatterns)))),
    }
)
