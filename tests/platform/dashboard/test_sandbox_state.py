"""Whether this server can run reward code, said before anything is written: GET /api/me/'s
"sandbox" and a warning on the Reward functions page and the New-run form. "Without
bubblewrap" is a PATH that really lacks bwrap; the probe starts (or fails to start) a real
sandbox."""
import os
import sys
import time

import pytest
from django.test import Client

from tests import sandbox_path
from tests.platform.servers import REPO, show_logs, start, stop, wait_until
from tests.sandbox_path import MISSING
from workers.rewards.sandbox_boundary import UNSAFE_ENV

# The sandbox fixtures, bound here so that pytest finds them: fresh_probe (autouse) for every
# test of this module, no_bwrap where a test names it.
fresh_probe, no_bwrap = sandbox_path.fresh_probe, sandbox_path.no_bwrap

PAGES = ["/rewards/", "/runs/new/"]
REAL_PATH = os.environ["PATH"]


@pytest.fixture
def page_a(db, alice):
    client = Client()
    client.force_login(alice)
    return client


def test_api_me_says_the_sandbox_is_unavailable_and_why_without_bubblewrap(api_a, no_bwrap):
    sandbox = api_a.get("/api/me/").json()["sandbox"]
    assert sandbox["available"] is False
    assert sandbox["reason"].startswith(MISSING)


def test_api_me_says_the_sandbox_is_proven_with_bubblewrap(api_a):
    sandbox = api_a.get("/api/me/").json()["sandbox"]
    assert sandbox["available"] is True
    assert sandbox["reason"].startswith("proven: a contained probe ran in bubblewrap")


@pytest.mark.parametrize("page", PAGES)
def test_reward_and_new_run_pages_warn_before_anything_is_written_without_bubblewrap(page_a, no_bwrap, page):
    html = page_a.get(page).content.decode()
    assert 'id="sandbox-unavailable"' in html
    assert "Reward code cannot run on this server" in html
    assert MISSING in html


@pytest.mark.parametrize("page", PAGES)
def test_reward_and_new_run_pages_have_no_warning_with_bubblewrap(page_a, page):
    response = page_a.get(page)
    assert response.status_code == 200
    assert 'id="sandbox-unavailable"' not in response.content.decode()


def test_the_unsafe_opt_in_banner_is_not_repeated_by_the_page_warning(page_a, no_bwrap, monkeypatch):
    monkeypatch.setenv(UNSAFE_ENV, "1")
    html = page_a.get("/rewards/").content.decode()
    assert 'id="unsafe-sandbox-banner"' in html and "bubblewrap is not installed" in html
    assert 'id="sandbox-unavailable"' not in html


# --- with FLUXRL_TRY_QUEUE, reward code runs in the sandbox service: the state is its own ----

def service_redis_url() -> str:
    from urllib.parse import urlsplit

    from django.conf import settings

    db = os.environ.get("FLUXRL_TEST_SANDBOX_STATE_REDIS_DB", "12")  # a database of this test's own
    return urlsplit(settings.REDIS_URL)._replace(path=f"/{db}").geturl()


@pytest.fixture
def service_queue(celery_broker_in_this_process, settings):
    """This (web) process sends to the sandbox service's queue in the test's Redis database."""
    import redis
    from kombu import pools

    from fluxrl.rewards.services import forget_sandbox_state

    if not settings.REDIS_URL:
        pytest.skip("needs Redis: set REDIS_URL=redis://...")
    app, url = celery_broker_in_this_process, service_redis_url()
    redis.Redis.from_url(url).flushdb()
    before = app.conf.broker_url, app.conf.result_backend
    app.conf.broker_url = app.conf.result_backend = url
    app._pool, app._backend_cache, app.amqp._producer_pool = None, None, None  # made for the memory broker
    settings.FLUXRL_TRY_QUEUE = "sandbox-state"
    forget_sandbox_state()
    yield url
    forget_sandbox_state()
    pools.reset()  # closes kombu's pools and forgets them: the next broker (or test) starts afresh
    app.conf.broker_url, app.conf.result_backend = before
    app._pool, app._backend_cache, app.amqp._producer_pool = None, None, None


@pytest.mark.timeout(180)
def test_with_a_sandbox_service_the_state_is_the_services_not_the_web_hosts(service_queue, api_a, no_bwrap, tmp_path):
    # The web process lacks bubblewrap (PATH); the service, started with the real PATH, has it.
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DJANGO_SECRET_KEY")}
    env.update(REDIS_URL=service_queue, FLUXRL_DATA_DIR=str(tmp_path / "service"), PATH=REAL_PATH,
               DJANGO_SETTINGS_MODULE="fluxrl.settings", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "platform"), str(REPO)]))
    log = tmp_path / "service.log"
    worker = start([sys.executable, "-m", "celery", "-A", "fluxrl.rewards.sandbox_app", "worker", "-Q", "sandbox-state",
                    "--concurrency", "1", "--loglevel", "INFO", "-n", f"sandbox-state-{os.getpid()}@%h"], env, log)
    try:
        wait_until(lambda: b" ready." in log.read_bytes() or worker.poll() is not None, 90, "the sandbox service")
        sandbox = api_a.get("/api/me/").json()["sandbox"]
    finally:
        stop(worker)
        show_logs(log)
    assert sandbox["available"] is True, sandbox
    assert sandbox["reason"].startswith("sandbox service: proven: a contained probe ran in bubblewrap")


def test_with_no_sandbox_service_answering_the_state_says_so(service_queue, api_a):
    from fluxrl.rewards.services import SERVICE_STATE_WAIT_S

    t0 = time.monotonic()
    sandbox = api_a.get("/api/me/").json()["sandbox"]
    assert SERVICE_STATE_WAIT_S <= time.monotonic() - t0 < SERVICE_STATE_WAIT_S + 5
    assert sandbox == {"available": False, "reason": "the reward sandbox service (queue 'sandbox-state') did not "
                                                     "answer within 5 s (TimeoutError)"}
    t0 = time.monotonic()
    assert api_a.get("/api/me/").json()["sandbox"] == sandbox  # kept a while: /api/me/ stays fast
    assert time.monotonic() - t0 < 1
