"""The try-it endpoint cannot tie up the web server: the work of one call is bounded,
and so is the number of calls scoring at once."""
import pytest

from fluxrl.rewards import services

CODE = "def reward(prompt, completion, **fields):\n    return float(completion == '2')\n"


def rows(n):
    return [{"prompt": "1+1=", "completion": "2"} for _ in range(n)]


def test_a_small_try_scores_every_row_in_the_real_sandbox(api_a, settings):
    response = api_a.post("/api/rewards/try/", {"code": CODE, "rows": rows(3), "timeout_s": 1.0})
    assert response.status_code == 200, response.content
    assert [r["reward"] for r in response.json()["results"]] == [1.0, 1.0, 1.0]


def test_rows_times_timeout_over_the_bound_is_refused_naming_both_fields(api_a, settings, assert_error):
    settings.FLUXRL_TRY_MAX_SECONDS = 10
    response = api_a.post("/api/rewards/try/", {"code": CODE, "rows": rows(6), "timeout_s": 2.0})
    assert response.status_code == 400
    error = response.json()["error"]
    assert {"rows", "timeout_s"} <= set(error["fields"]) and "10 s" in error["message"]


def test_without_a_timeout_the_per_row_timeout_shrinks_to_fit_the_bound(api_a, settings, monkeypatch):
    settings.FLUXRL_TRY_MAX_SECONDS = 10
    seen = {}

    def fake_try(code, rows, timeout_s, memory_mb):  # records what the sandbox would be given
        seen["timeout_s"] = timeout_s
        return {"ok": True, "error": None, "results": [{"reward": 1.0, "error": None, "ms": 0.1}] * len(rows)}

    monkeypatch.setattr(services, "try_reward", fake_try)
    assert api_a.post("/api/rewards/try/", {"code": CODE, "rows": rows(20)}).status_code == 200
    assert seen["timeout_s"] == pytest.approx(0.5)
    assert api_a.post("/api/rewards/try/", {"code": CODE, "rows": rows(2)}).status_code == 200
    assert seen["timeout_s"] == 2.0


def test_too_many_tries_at_once_get_429_with_retry_after(api_a, settings):
    settings.FLUXRL_TRY_MAX_CONCURRENT = 1
    slot = services._try_slot()
    assert slot.acquire(blocking=False)  # another request is scoring
    try:
        response = api_a.post("/api/rewards/try/", {"code": CODE, "rows": rows(1), "timeout_s": 1.0})
    finally:
        slot.release()
    assert response.status_code == 429 and int(response["Retry-After"]) >= 1
    assert response.json()["error"]["code"] == "too_many_requests"
    again = api_a.post("/api/rewards/try/", {"code": CODE, "rows": rows(1), "timeout_s": 1.0})
    assert again.status_code == 200  # the slot is free again


def test_a_failing_try_gives_its_slot_back(api_a, settings):
    settings.FLUXRL_TRY_MAX_CONCURRENT = 1
    for _ in range(3):
        response = api_a.post("/api/rewards/try/", {"code": "def reward(:", "rows": rows(1), "timeout_s": 1.0})
        assert response.status_code == 200 and response.json()["ok"] is False


def test_rows_read_from_a_dataset_are_named_n_in_the_errors(api_a, settings, dataset_a):
    settings.FLUXRL_TRY_MAX_SECONDS = 1
    body = {"code": CODE, "team": "team-a", "dataset": "add@1", "n": 5, "timeout_s": 1.0}
    error = api_a.post("/api/rewards/try/", body).json()["error"]
    assert {"n", "timeout_s"} == set(error["fields"])


def test_the_dashboard_form_at_its_largest_stays_within_the_bound(api_a, client, alice, dataset_a, settings):
    """The reward page's try form sends {team, code, dataset, n} (rewards.js), no
    timeout_s, and lets n go up to FLUXRL_REWARD_TRY_MAX_ROWS: that must score, not 400."""
    client.force_login(alice)
    page = client.get("/rewards/").content.decode()
    most = settings.FLUXRL_REWARD_TRY_MAX_ROWS
    assert f'name="n" type="number" min="1" max="{most}"' in page
    body = {"team": "team-a", "code": CODE, "dataset": "add@1", "n": most}
    response = api_a.post("/api/rewards/try/", body)
    assert response.status_code == 200, response.content
    assert len(response.json()["results"]) == most and all(r["error"] is None for r in response.json()["results"])


def test_the_schema_documents_the_429_and_its_retry_after(api_a):
    paths = api_a.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()["paths"]  # signed-in only
    for path in ("/api/rewards/try/", "/api/rewards/{id}/try/"):
        too_many = paths[path]["post"]["responses"]["429"]
        assert "Retry-After" in too_many["headers"] and too_many["content"]["application/json"]


def test_under_asgi_the_sandbox_scores_off_the_event_loop_without_a_database_connection(
        transactional_db, alice, team_a, monkeypatch):
    """daphne serves the API through Django's ASGI handler, which runs sync DRF views in a
    worker thread (sync_to_async): the blocking sandbox call must land there, not on the
    event loop, and must not hold a database connection while it scores."""
    import asyncio
    import json
    import threading

    from asgiref.sync import async_to_sync
    from asgiref.testing import ApplicationCommunicator
    from django.db import connection, connections

    from fluxrl.accounts.services import create_api_token
    from fluxrl.asgi import application

    seen, events = {}, []
    wrapper = type(connections["default"])
    close = wrapper.close

    def spy_close(self):  # SQLite ignores close() on the in-memory test database: watch the call
        events.append(("close", threading.current_thread()))
        close(self)

    monkeypatch.setattr(wrapper, "close", spy_close)

    def fake_try(code, rows, timeout_s, memory_mb):
        events.append(("score", threading.current_thread()))
        try:
            asyncio.get_running_loop()
            seen["on_loop"] = True
        except RuntimeError:
            seen["on_loop"] = False
        seen["thread"] = threading.current_thread()
        in_memory = connection.vendor == "sqlite" and connection.is_in_memory_db()  # close() keeps those open
        seen["connected"] = connection.connection is not None and not in_memory
        return {"ok": True, "error": None, "results": [{"reward": 1.0, "error": None, "ms": 0.1}] * len(rows)}

    monkeypatch.setattr(services, "try_reward", fake_try)
    key = create_api_token(alice, "asgi")[1]
    body = json.dumps({"code": CODE, "rows": rows(2), "timeout_s": 1.0}).encode()

    async def post():
        scope = {"type": "http", "http_version": "1.1", "method": "POST", "path": "/api/rewards/try/",
                 "query_string": b"", "scheme": "http", "server": ("localhost", 80),
                 "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"),
                             (b"content-length", str(len(body)).encode()), (b"authorization", f"Bearer {key}".encode())]}
        app = ApplicationCommunicator(application, scope)
        await app.send_input({"type": "http.request", "body": body})
        start = await app.receive_output(20)
        seen["loop_thread"] = threading.current_thread()
        return start["status"]

    assert async_to_sync(post)() == 200
    assert seen["on_loop"] is False and seen["thread"] is not seen["loop_thread"]
    scoring = events.index(("score", seen["thread"]))
    assert ("close", seen["thread"]) in events[:scoring] and seen["connected"] is False
