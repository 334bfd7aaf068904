"""A small Python client for the FluxRL platform: the REST API and a run's live
websocket. No Django; `requests` and `websockets` only.

    client = FluxClient("http://127.0.0.1:8000", "flxu_...")
    run = client.submit(Path("examples/add-async.yaml").read_text(), tags=["demo"])
    async for message in client.events(run["id"]):   # status, metrics, samples
        ...
"""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Iterator
from urllib.parse import urlencode, urlsplit

import requests

TERMINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled"})
RECONNECT_DELAYS_S = (0.5, 1, 2, 5, 10)


class ApiError(Exception):
    """An error answer of the platform: HTTP status (or websocket close code - 4000),
    the API's error code, its message and the fields it names."""

    def __init__(self, status: int, code: str, message: str, fields: dict | None = None):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.fields = status, code, message, fields or {}

    @classmethod
    def from_response(cls, response: requests.Response) -> "ApiError":
        try:
            error = response.json()["error"]
            return cls(response.status_code, error["code"], error["message"], error.get("fields"))
        except (ValueError, KeyError, TypeError):
            return cls(response.status_code, "http_error", response.text[:300] or response.reason)


class FluxClient:
    def __init__(self, url: str, token: str, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"

    # --- REST ---------------------------------------------------------------------

    def request(self, method: str, path: str, **kwargs):
        url = path if path.startswith("http") else f"{self.url}/api/{path.lstrip('/')}"
        response = self.session.request(method, url, timeout=self.timeout, **kwargs)
        if response.status_code >= 400:
            raise ApiError.from_response(response)
        return response.json() if response.content else None

    def pages(self, path: str, params: dict | None = None) -> Iterator[dict]:
        """Every item of a paginated list, page after page."""
        page = self.request("GET", path, params=params)
        while True:
            yield from page["results"]
            if not page.get("next"):
                return
            page = self.request("GET", page["next"])

    def me(self) -> dict:
        return self.request("GET", "me/")

    def submit(self, spec: str | dict, tags=(), notes: str = "", team: str | None = None) -> dict:
        """Submit a run spec (YAML/JSON text or a mapping); returns the queued run."""
        body = {"spec": spec, "tags": list(tags), "notes": notes, **({"team": team} if team else {})}
        return self.request("POST", "runs/", json=body)

    def runs(self, **filters) -> list[dict]:
        """The runs of your teams, newest first; filters: status, tag, owner, team, q."""
        return list(self.pages("runs/", {k: v for k, v in filters.items() if v}))

    def run(self, run_id: int) -> dict:
        return self.request("GET", f"runs/{run_id}/")

    def cancel(self, run_id: int) -> dict:
        return self.request("POST", f"runs/{run_id}/cancel/")

    def resume(self, run_id: int) -> dict:
        """Queue a failed or cancelled run again, from its newest checkpoint."""
        return self.request("POST", f"runs/{run_id}/resume/")

    def samples(self, run_id: int, since_step: int | None = None) -> Iterator[dict]:
        params = {"since_step": since_step} if since_step is not None else None
        return self.pages(f"runs/{run_id}/samples/", params)

    def metrics(self, run_id: int, keys=(), since_step: int | None = None, max_points: int = 1000) -> dict:
        params = {"keys": ",".join(keys), "since_step": since_step, "max_points": max_points}
        return self.request("GET", f"runs/{run_id}/metrics/", params={k: v for k, v in params.items() if v not in ("", None)})

    # --- live ---------------------------------------------------------------------

    def ws_url(self, run_id: int, since_step: int | None = None) -> str:
        parts = urlsplit(self.url)
        scheme = "wss" if parts.scheme == "https" else "ws"
        query = f"?{urlencode({'since_step': since_step})}" if since_step is not None else ""
        return f"{scheme}://{parts.netloc}{parts.path}/ws/runs/{run_id}/{query}"

    async def events(self, run_id: int, since_step: int | None = None, reconnect: bool = True) -> AsyncIterator[dict]:
        """The run's live messages: on connect its status, metric history and recent
        samples, then every change. A dropped connection is reopened with since_step =
        the last step received, so the history resent is only what was missed. Raises
        ApiError when the server refuses (close codes 4400-4404)."""
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

        failures = 0
        while True:
            try:
                # The server checks Origin against its allowed hosts (browsers' cross-site
                # protection); a token client says it comes from the server itself.
                async with connect(self.ws_url(run_id, since_step), origin=self.url,
                                   additional_headers={"Authorization": f"Bearer {self.token}"},
                                   max_size=2**26, open_timeout=self.timeout) as ws:
                    async for raw in ws:
                        failures = 0
                        message = json.loads(raw)
                        if message.get("type") == "metrics" and message.get("points"):
                            since_step = max([since_step or 0, *(p["step"] for p in message["points"])])
                        yield message
                    close, reason = ws.close_code, ws.close_reason
            except InvalidStatus as exc:
                raise ApiError(exc.response.status_code, "refused", f"websocket handshake refused by {self.url}") from None
            except ConnectionClosed as exc:
                close, reason = (exc.rcvd.code, exc.rcvd.reason) if exc.rcvd else (None, "")
            except (InvalidHandshake, OSError):  # server down or restarting: try again
                close, reason = None, ""
            if close is not None and 4000 <= close < 5000:
                raise ApiError(close - 4000, "refused", reason or "the server refused the subscription")
            if not reconnect:
                return
            await asyncio.sleep(RECONNECT_DELAYS_S[min(failures, len(RECONNECT_DELAYS_S) - 1)])
            failures += 1
