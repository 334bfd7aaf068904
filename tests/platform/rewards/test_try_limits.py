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
