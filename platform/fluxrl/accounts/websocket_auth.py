"""Websocket authentication by API token, for clients without the session cookie:
`Authorization: Bearer <key>` (CLI, scripts) or `?token=<key>` (browsers cannot set
headers on a websocket). Sits inside AuthMiddlewareStack: a token wins over the session."""
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.middleware import BaseMiddleware
from django.contrib.auth.models import AnonymousUser

from .services import authenticate_key


def token_from_scope(scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            kind, _, key = value.decode("latin-1").partition(" ")
            if kind.lower() == "bearer" and key.strip():
                return key.strip()
    return (parse_qs(scope.get("query_string", b"").decode()).get("token") or [None])[0]


class TokenAuthMiddleware(BaseMiddleware):
    async def __call__(self, scope, receive, send):
        key = token_from_scope(scope)
        if key:
            found = await database_sync_to_async(authenticate_key)(key)
            # A bad key does not fall back to the session: the client asked to be someone.
            user, token = found if found else (AnonymousUser(), None)
            scope = dict(scope, user=user, auth=token)
        return await super().__call__(scope, receive, send)
