"""Try-it through the sandbox service (FLUXRL_TRY_QUEUE): a real Celery worker of
fluxrl.rewards.sandbox_app on the `sandbox` queue of Redis scores the rows, in a process
that is not the web process; with no worker up the request is answered 503 at the deadline.
The worker gets no DATABASE_URL and no secret, as in docker-compose.yml."""
import logging
import os
import sys
import time
from urllib.parse import urlsplit

import pytest
from django.conf import settings

from tests.platform.servers import REPO, show_logs, start, stop, wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.django_db,
              pytest.mark.skipif(not settings.REDIS_URL, reason="needs Redis: set REDIS_URL=redis://...")]

CODE = "def reward(prompt, completion, **fields):\n    return float(len(completion))\n"
ROWS = [{"prompt": "p", "completion": "abc"}, {"prompt": "p", "completion": "hello"}]


def redis_url() -> str:
    db = os.environ.get("FLUXRL_TEST_SANDBOX_REDIS_DB", "13")  # a database of this test's own
    return urlsplit(settings.REDIS_URL)._replace(path=f"/{db}").geturl()


@pytest.fixture
def broker(celery_broker_in_this_process, settings):
    """This process (the web process) sends to and reads answers from the test's Redis database."""
    import redis

    app, url = celery_broker_in_this_process, redis_url()
    redis.Redis.from_url(url).flushdb()
    before = app.conf.broker_url, app.conf.result_backend
    app.conf.broker_url = app.conf.result_backend = url
    reset_connections(app)  # those made for the memory broker
    settings.FLUXRL_TRY_QUEUE = "sandbox"
    yield url
    app.conf.broker_url, app.conf.result_backend = before
    reset_connections(app)


def reset_connections(app) -> None:
    """Forget the app's connection pools and result backend (as Celery does after a fork)."""
    app._after_fork()
    app._backend_cache = None
    app._local.__dict__.pop("backend", None)


@pytest.fixture
def sandbox_worker(broker, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DJANGO_SECRET_KEY")}
    env.update(REDIS_URL=broker, FLUXRL_DATA_DIR=str(tmp_path / "sandbox-data"), DJANGO_SETTINGS_MODULE="fluxrl.settings",
               PYTHONPATH=os.pathsep.join([str(REPO / "platform"), str(REPO)]), PYTHONUNBUFFERED="1")
    log = tmp_path / "sandbox.log"
    proc = start([sys.executable, "-m", "celery", "-A", "fluxrl.rewards.sandbox_app", "worker", "-Q", "sandbox",
                  "--concurrency", "1", "--loglevel", "INFO", "-n", f"sandbox-{os.getpid()}@%h"], env, log)
    try:
        wait_until(lambda: b" ready." in log.read_bytes() or proc.poll() is not None, 90, "the sandbox worker", every=0.5)
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        yield proc
    finally:
        stop(proc)
        show_logs(log)


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_try_it_is_scored_by_the_sandbox_workers_process_not_the_web_process(sandbox_worker, api_a, caplog):
    caplog.set_level(logging.INFO, logger="fluxrl.rewards.services")
    response = api_a.post("/api/rewards/try/", {"code": CODE, "rows": ROWS}, format="json")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["ok"] is True
    assert [r["reward"] for r in body["results"]] == [3.0, 5.0]
    assert "scored_by" not in body  # which process scored stays out of the API
    [record] = [r for r in caplog.records if "scored by" in r.getMessage()]
    host, pid = record.args[1], int(record.args[2])
    assert pid != os.getpid()
    # the worker's pool process (prefork child of the worker started above)
    assert pid == sandbox_worker.pid or parent_pid(pid) == sandbox_worker.pid
    assert host == os.uname().nodename


def test_try_it_with_no_sandbox_worker_up_answers_503_within_the_deadline(broker, settings, api_a):
    settings.FLUXRL_TRY_DEADLINE_S = 3.0
    t0 = time.monotonic()
    response = api_a.post("/api/rewards/try/", {"code": CODE, "rows": ROWS}, format="json")
    elapsed = time.monotonic() - t0
    assert response.status_code == 503, response.content
    assert response.json()["error"]["code"] == "sandbox_unavailable"
    assert "sandbox service did not answer within 3 s" in response.json()["error"]["message"]
    assert response["Retry-After"] == "5"
    assert 3.0 <= elapsed < 5.0


def test_try_it_without_the_setting_scores_in_a_child_of_the_web_process(settings, api_a, caplog):
    settings.FLUXRL_TRY_QUEUE = ""
    response = api_a.post("/api/rewards/try/", {"code": CODE, "rows": ROWS}, format="json")
    assert response.status_code == 200, response.content
    assert [r["reward"] for r in response.json()["results"]] == [3.0, 5.0]
