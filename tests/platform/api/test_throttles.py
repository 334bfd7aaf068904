"""Rates: failed password sign-ins per client address (every login view) and API requests
per user, each a 429 with Retry-After past its rate; successes and run tokens do not count."""
import pytest
from django.core.cache import cache
from django.test import Client



@pytest.fixture(autouse=True)
def fresh_counts():
    cache.clear()  # the throttles count in Django's cache, shared by the whole test process
    yield
    cache.clear()


@pytest.fixture
def login_rate(settings):
    def set_rate(rate: str):
        settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK,
                                   "DEFAULT_THROTTLE_RATES": {**settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"],
                                                              "login": rate}}
    return set_rate


@pytest.mark.parametrize("path", ["/login/", "/api-auth/login/", "/admin/login/"])
def test_sign_in_is_429_after_n_failures_from_one_address(alice, login_rate, path):
    login_rate("3/min")
    alice.set_password("s3cret-pass")
    alice.is_staff = True  # the admin's login takes staff only
    alice.save()
    client = Client()
    for _ in range(3):
        wrong = client.post(path, {"username": "alice", "password": "nope"})
        assert wrong.status_code == 200  # the form again, with its error
    refused = client.post(path, {"username": "alice", "password": "s3cret-pass"})
    assert refused.status_code == 429
    assert 1 <= int(refused["Retry-After"]) <= 60
    # another address is not held back
    other = Client(REMOTE_ADDR="10.0.0.9").post(path, {"username": "alice", "password": "s3cret-pass"})
    assert other.status_code == 302


def test_successful_sign_ins_do_not_count(alice, login_rate):
    login_rate("2/min")
    alice.set_password("s3cret-pass")
    alice.save()
    for _ in range(5):
        assert Client().post("/login/", {"username": "alice", "password": "s3cret-pass"}).status_code == 302


def test_the_api_is_429_with_retry_after_past_a_users_rate(api_a, api_b, settings, assert_error):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {
        **settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"], "user": "5/min"}}
    for _ in range(5):
        assert api_a.get("/api/runs/").status_code == 200
    error = assert_error(api_a.get("/api/runs/"), 429, "throttled")
    assert error["message"]
    assert int(api_a.get("/api/runs/")["Retry-After"]) >= 1
    assert api_b.get("/api/runs/").status_code == 200  # another user has a count of their own


def test_run_tokens_are_not_counted(run_a, worker_client, settings):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {
        **settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"], "user": "2/min"}}
    worker = worker_client(run_a)
    for _ in range(5):
        assert worker.get(f"/api/runs/{run_a.pk}/status/").status_code == 200


def test_the_default_rates_come_from_the_environment(monkeypatch):
    import importlib

    import fluxrl.settings as project_settings

    monkeypatch.setenv("FLUXRL_API_RATE", "7/hour")
    monkeypatch.setenv("FLUXRL_LOGIN_RATE", "none")
    try:
        rates = importlib.reload(project_settings).REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]
        assert rates == {"user": "7/hour", "login": None}
    finally:
        monkeypatch.undo()
        importlib.reload(project_settings)
