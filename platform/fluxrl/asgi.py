"""ASGI entry (daphne fluxrl.asgi:application): HTTP goes to Django, websockets to
the routes in fluxrl/routing.py."""
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

# Static files (admin, API docs, dashboard) straight from the app folders: no
# collectstatic or extra server needed at this scale; FLUXRL_SERVE_STATIC=0 to leave it to a proxy.
http_app = ASGIStaticFilesHandler(django_asgi_app) if settings.FLUXRL_SERVE_STATIC else django_asgi_app

application = ProtocolTypeRouter(
    {
        "http": http_app,
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(TokenAuthMiddleware(URLRouter(websocket_urlpatterns)))),
    }
)
