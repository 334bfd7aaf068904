"""The whole path with real parts: PostgreSQL, Redis, a Celery worker process (not
eager), a daphne server, the Python client and the real engine on the tiny model.
Three runs: one to the end; one cancelled and one whose engine is SIGKILLed, both as
soon as the engine has started its vLLM processes (the costly part of a run here).

Needs DATABASE_URL (PostgreSQL) and REDIS_URL; skipped otherwise. The servers use this
session's test database and a Redis database of their own (FLUXRL_TEST_REDIS_DB,
default 14, flushed first), so a worker on the developer's queues never sees the runs."""
import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection

from fluxrl.accounts.models import Membership, Role, Team
from fluxrl.accounts.services import create_api_token
from fluxrl.metrics.models import MetricPoint
from fluxrl.runs.models import Run
from tests.platform.servers import free_port, start, stop, wait_until
from workers.io.client import FluxClient

psutil = pytest.importorskip("psutil")
pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(900),
    pytest.mark.django_db(transaction=True),  # the servers must see what the test writes
    pytest.mark.skipif(
        not (settings.DATABASES["default"]["ENGINE"].endswith("postgresql") and settings.REDIS_URL),
        reason="needs real PostgreSQL and Redis: set DATABASE_URL=postgres://... and REDIS_URL=redis://...",
    ),
]

REPO = Path(__file__).resolve().parents[3]
QUICK_SPEC = """\
name: quick
model: {path: "builtin:tiny"}
task: {dataset: "gen:add?max_digits=2", size: 300, eval_size: 20}
reward: {function: numeric_match}
algorithm: {loss: ppo, group_size: 4, lr: 1.0e-3}
rollout: {engines: 1, max_tokens: 16, update_mode: keep}
schedule: {mode: async, max_staleness: 2, batch_prompts: 4}
stop: {max_steps: 12, max_minutes: 5}
eval: {every_steps: 0, prompts: 20}
"""


@pytest.fixture(scope="module")
def stack(django_db_setup, django_db_blocker, tmp_path_factory):
    """daphne and a Celery worker on the test database; yields the server's URL."""
    database = urlsplit(os.environ["DATABASE_URL"])._replace(path=f"/{connection.settings_dict['NAME']}").geturl()
    redis_url = urlsplit(settings.REDIS_URL)._replace(path=f"/{os.environ.get('FLUXRL_TEST_REDIS_DB', '14')}").geturl()
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    port, data = free_port(), tmp_path_factory.mktemp("stack")
    env = {**os.environ, "DATABASE_URL": database, "REDIS_URL": redis_url, "FLUXRL_DATA_DIR": str(data),
           "FLUXRL_PUBLIC_URL": f"http://127.0.0.1:{port}", "FLUXRL_CANCEL_GRACE_S": "5",
           "PYTHONPATH": os.pathsep.join(["platform", "."]), "DJANGO_SETTINGS_MODULE": "fluxrl.settings"}
    web = start([sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "fluxrl.asgi:application"],
                env, data / "daphne.log")
    worker = start([sys.executable, "-m", "celery", "-A", "fluxrl", "worker", "-Q", "cpu,gpu", "--concurrency", "1",
                    "--loglevel", "INFO", "-n", f"test-{port}@%h"], env, data / "celery.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: reachable(url), 120, "daphne")
        wait_until(lambda: b" ready." in (data / "celery.log").read_bytes(), 90, "the Celery worker")
        yield url
    finally:
        stop(worker)
        stop(web)
        for name in ("daphne.log", "celery.log"):
            print(f"--- {name} (tail)\n" + (data / name).read_text(errors="replace")[-3000:])
        # pytest-django drops the test database at the end: let the servers' sessions go first.
        with django_db_blocker.unblock():
            deadline = time.monotonic() + 20
            while other_sessions() and time.monotonic() < deadline:
                time.sleep(0.2)


def other_sessions() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()")
        return cursor.fetchone()[0]


def reachable(url: str) -> bool:
    try:
        return requests.get(f"{url}/api/me/", timeout=10).status_code == 401
    except requests.RequestException:  # not listening yet, or still importing
        return False


@pytest.fixture
def client(stack):
    user = get_user_model().objects.create(username="it")
    Membership.objects.create(user=user, team=Team.objects.create(name="IT", slug="it"), role=Role.ADMIN)
    return FluxClient(stack, create_api_token(user, "it")[1])


def run_row(run_id: int) -> Run:
    return Run.objects.get(pk=run_id)


def engine_tree(run_id: int) -> list:
    """The engine process and all its descendants (vLLM engine core, workers), once
    the engine has started at least one child."""
    run = run_row(run_id)
    if run.status != "running" or not run.worker_pid:
        return []
    try:
        engine = psutil.Process(run.worker_pid)
        children = engine.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [engine, *children] if children else []


def survivors(processes: list) -> list[str]:
    """What is left of ``processes``, each as pid and command line (for the failure message)."""
    _, alive = psutil.wait_procs(processes, timeout=0)
    left = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid}: {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return left


def all_gone(processes: list) -> bool:
    return not survivors(processes)


async def follow(client: FluxClient, run_id: int) -> list[dict]:
    messages = []
    async for message in client.events(run_id):
        messages.append(message)
        if message["type"] == "status" and message["status"] in ("succeeded", "failed", "cancelled"):
            return messages


def test_a_run_goes_from_queued_to_succeeded_with_live_metrics(client):
    run = client.submit(QUICK_SPEC, tags=["it"])
    messages = asyncio.run(asyncio.wait_for(follow(client, run["id"]), 600))

    statuses = [run["status"]] + [m["status"] for m in messages if m["type"] == "status"]
    seen = [s for i, s in enumerate(statuses) if i == 0 or s != statuses[i - 1]]
    assert seen == ["queued", "starting", "running", "succeeded"], (seen, run_row(run["id"]).failure_reason)

    histories = [m for m in messages if m["type"] == "metrics" and m.get("history")]
    assert len(histories) == 1  # one connection all along: no drop while the engine started
    live_steps = [max(p["step"] for p in m["points"]) for m in messages if m["type"] == "metrics" and not m.get("history")]
    assert len(set(live_steps)) >= 2 and live_steps == sorted(live_steps), live_steps

    row = run_row(run["id"])
    assert row.worker_host and row.worker_pid and row.started_at <= row.finished_at
    keys = set(MetricPoint.objects.filter(run=row).values_list("key", flat=True))
    assert {"reward/mean", "throughput/samples_per_s", "staleness/max"} <= keys
    assert row.samples.exists(), "the engine's samples were not stored (rejected by POST /samples/?)"
    assert any(m["type"] == "samples" and m["samples"] for m in messages)


def test_a_running_run_is_cancelled_within_seconds_and_leaves_no_process(client):
    run = client.submit(QUICK_SPEC, tags=["it-cancel"])
    tree = wait_until(lambda: engine_tree(run["id"]), 300, "the engine's child processes")
    asked = time.monotonic()
    assert client.cancel(run["id"])["cancel_requested"] is True
    wait_until(lambda: run_row(run["id"]).status == "cancelled", 30, "the run to be cancelled")
    # The engine may report its interruption (counted as the cancel) while the watcher
    # still stops its group: 1 s poll, then up to 5 s of grace before SIGKILL.
    wait_until(lambda: all_gone(tree), 20, "the engine's processes to be gone")
    assert time.monotonic() - asked < 25, [p.pid for p in tree]


def test_a_killed_engine_fails_the_run_with_a_reason_and_leaves_no_process(client):
    run = client.submit(QUICK_SPEC, tags=["it-crash"])
    tree = wait_until(lambda: engine_tree(run["id"]), 300, "the engine's child processes")
    os.kill(tree[0].pid, signal.SIGKILL)
    row = wait_until(lambda: (r := run_row(run["id"])).is_terminal and r, 60, "the run to end")
    assert row.status == "failed" and row.failure_reason.startswith("The engine was killed by SIGKILL.")
    deadline = time.monotonic() + 15
    while not all_gone(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all_gone(tree), f"the engine's children outlived it by 15 s: {survivors(tree)}"
