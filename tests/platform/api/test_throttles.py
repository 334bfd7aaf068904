"""Rates: failed password sign-ins per client address and per submitted username (every
login view) and API requests per user, each a 429 with Retry-After past its rate;
successes and run tokens do not count. The address is the peer's: X-Forwarded-For counts
only behind the proxies FLUXRL_TRUSTED_PROXIES names."""
import re

import pytest
import requests
from django.core.cache import cache
from django.test import Client, RequestFactory

from fluxrl.api.throttles import client_address

LOGIN_PATHS = ["/login/", "/api-auth/login/", "/admin/login/"]


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


@pytest.fixture
def rates(settings):
    def set_rates(**scopes):
        settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK,
                                   "DEFAULT_THROTTLE_RATES": {**settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"],
                                                              **scopes}}
    return set_rates


@pytest.fixture
def staff_alice(alice):
    alice.set_password("s3cret-pass")
    alice.is_staff = True  # the admin's login takes staff only
    alice.save()
    return alice


def sign_in(session: requests.Session, url: str, username: str, password: str, **headers) -> requests.Response:
    """A browser's sign-in over HTTP: the form's CSRF cookie first, then the post."""
    session.get(url, timeout=30)
    return session.post(url, {"username": username, "password": password,
                              "csrfmiddlewaretoken": session.cookies.get("csrftoken", "")},
                        headers={"Referer": url, **headers}, allow_redirects=False, timeout=30)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", LOGIN_PATHS)
def test_a_new_x_forwarded_for_on_each_guess_is_still_429_on_the_real_server(live_server, staff_alice, rates, path):
    rates(login="3/min", login_user=None)  # the address alone must hold the guesser
    session = requests.Session()
    url = live_server.url + path
    for i in range(3):
        wrong = sign_in(session, url, "alice", "nope", **{"X-Forwarded-For": f"198.51.100.{i + 1}"})
        assert wrong.status_code == 200, wrong.text[:300]
    refused = sign_in(session, url, "alice", "s3cret-pass", **{"X-Forwarded-For": "203.0.113.77"})
    assert refused.status_code == 429, refused.text[:300]
    assert "this address" in refused.text and 1 <= int(refused.headers["Retry-After"]) <= 60


@pytest.mark.parametrize("path", LOGIN_PATHS)
def test_behind_a_trusted_proxy_the_forwarded_client_is_counted(staff_alice, rates, settings, path):
    rates(login="3/min", login_user=None)
    settings.FLUXRL_TRUSTED_PROXIES = ["10.0.0.0/8"]

    def via_proxy(client_ip: str, password: str, claimed: str = "192.0.2.1"):
        # the proxy appends the address it saw; what the client wrote stays to the left
        return Client(REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR=f"{claimed}, {client_ip}").post(
            path, {"username": "alice", "password": password})

    for i in range(3):
        assert via_proxy("203.0.113.5", "nope", claimed=f"192.0.2.{i + 10}").status_code == 200
    assert via_proxy("203.0.113.5", "s3cret-pass").status_code == 429
    assert via_proxy("203.0.113.6", "s3cret-pass").status_code == 302  # another client of the same proxy


def test_the_client_address_is_the_peer_unless_it_is_a_trusted_proxy(settings):
    def address(peer: str, forwarded: str | None = None) -> str:
        extra = {"HTTP_X_FORWARDED_FOR": forwarded} if forwarded is not None else {}
        return client_address(RequestFactory().get("/", REMOTE_ADDR=peer, **extra))

    assert address("203.0.113.9", "1.2.3.4") == "203.0.113.9"  # no proxies configured
    settings.FLUXRL_TRUSTED_PROXIES = ["10.0.0.0/8", "192.168.1.1"]
    assert address("203.0.113.9", "1.2.3.4, 10.0.0.3") == "203.0.113.9"  # not from a proxy: header ignored
    assert address("10.0.0.3", "1.2.3.4, 203.0.113.9") == "203.0.113.9"
    assert address("10.0.0.3", "1.2.3.4, 203.0.113.9, 192.168.1.1") == "203.0.113.9"  # two trusted hops
    assert address("10.0.0.3", "203.0.113.9, not-an-ip") == "10.0.0.3"  # garbage: the proxy, not the client's words
    assert address("10.0.0.3") == "10.0.0.3"
    settings.FLUXRL_TRUSTED_PROXIES = []
    settings.FLUXRL_NUM_PROXIES = 1
    assert address("10.0.0.3", "1.2.3.4, 203.0.113.9") == "203.0.113.9"


@pytest.mark.parametrize("path", LOGIN_PATHS)
def test_failures_for_one_username_from_many_addresses_lock_that_username(staff_alice, bob, rates, path):
    rates(login="100/min", login_user="3/min")
    bob.set_password("bob-pass-1")
    bob.is_staff = True
    bob.save()
    bodies = {}
    for username in ("alice", "no-such-user"):  # counted per submitted name, whether or not it exists
        for i in range(3):
            wrong = Client(REMOTE_ADDR=f"198.51.100.{i + 1}").post(path, {"username": username, "password": "nope"})
            assert wrong.status_code == 200
        locked = Client(REMOTE_ADDR="203.0.113.50").post(path, {"username": username, "password": "s3cret-pass"})
        assert locked.status_code == 429
        assert 1 <= int(locked["Retry-After"]) <= 60
        bodies[username] = re.sub(r"\d+", "N", locked.content.decode())
    assert "temporarily locked" in bodies["alice"]
    assert bodies["alice"] == bodies["no-such-user"]  # a 429 says nothing about who exists
    # another user signs in at once, from one of the guessing addresses too
    assert Client(REMOTE_ADDR="198.51.100.1").post(path, {"username": "bob", "password": "bob-pass-1"}).status_code == 302
    assert Client(REMOTE_ADDR="198.51.100.1").post(path, {"username": "ALICE ", "password": "nope"}).status_code == 429


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
        assert rates == {"user": "7/hour", "login": None, "login_user": "20/hour"}
    finally:
        monkeypatch.undo()
        importlib.reload(project_settings)
