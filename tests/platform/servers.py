"""Real server processes for platform integration tests: daphne serving fluxrl.asgi and
a Celery worker, both on this test session's database, so what a test writes they see
(tests using them need django_db(transaction=True)). PostgreSQL only: pytest-django's
SQLite test database lives in memory, out of another process' reach. Redis, when
REDIS_URL is set, is a database of the servers' own (FLUXRL_TEST_REDIS_DB, flushed),
so a worker on the developer's queues never sees these runs."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests
from django.conf import settings
from django.db import connection

from workers.io import ports

REPO = Path(__file__).resolve().parents[2]

ON_POSTGRES = settings.DATABASES["default"]["ENGINE"].endswith("postgresql")
needs_postgres = pytest.mark.skipif(not ON_POSTGRES, reason="needs PostgreSQL: set DATABASE_URL=postgres://...")
needs_postgres_and_redis = pytest.mark.skipif(
    not (ON_POSTGRES and settings.REDIS_URL),
    reason="needs real PostgreSQL and Redis: set DATABASE_URL=postgres://... and REDIS_URL=redis://...",
)


def free_port() -> int:
    """A port for a server this test starts (outside the ephemeral range: workers/io/ports.py)."""
    return ports.free_port("127.0.0.1")


def wait_until(check, timeout: float, what: str, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(every)


def server_env(data_dir: Path, port: int, **extra: str) -> dict:
    """The environment of a server process on the test database (call with the database set up)."""
    database = urlsplit(os.environ["DATABASE_URL"])._replace(path=f"/{connection.settings_dict['NAME']}").geturl()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    env.update(DATABASE_URL=database, FLUXRL_DATA_DIR=str(data_dir), FLUXRL_PUBLIC_URL=f"http://127.0.0.1:{port}",
               PYTHONPATH=os.pathsep.join([str(REPO / "platform"), str(REPO)]),
               DJANGO_SETTINGS_MODULE="fluxrl.settings", PYTHONUNBUFFERED="1")
    if settings.REDIS_URL:
        import redis

        db = os.environ.get("FLUXRL_TEST_REDIS_DB", "14")
        env["REDIS_URL"] = urlsplit(settings.REDIS_URL)._replace(path=f"/{db}").geturl()
        redis.Redis.from_url(env["REDIS_URL"]).flushdb()
    env.update(extra)
    return env


def start(command: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    """A process in its own group (so stop() takes its children too), output appended to log_path."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except ProcessLookupError:
            proc.wait()
            return
        except subprocess.TimeoutExpired:
            continue


def reachable(url: str) -> bool:
    try:
        return requests.get(f"{url}/api/me/", timeout=10).status_code == 401
    except requests.RequestException:  # not listening yet, or still importing
        return False


def start_daphne(env: dict, port: int, log_path: Path, timeout: float = 120) -> subprocess.Popen:
    proc = start([sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "fluxrl.asgi:application"],
                 env, log_path)
    try:
        wait_until(lambda: proc.poll() is not None or reachable(f"http://127.0.0.1:{port}"), timeout, "daphne")
    except AssertionError:
        stop(proc)
        raise
    assert proc.poll() is None, f"daphne exited:\n{log_path.read_text(errors='replace')[-3000:]}"
    return proc


def start_celery_worker(env: dict, queues: str, name: str, log_path: Path, timeout: float = 90) -> subprocess.Popen:
    """One worker process with one slot (--concurrency 1), as a GPU host runs one run at a time."""
    proc = start([sys.executable, "-m", "celery", "-A", "fluxrl", "worker", "-Q", queues, "--concurrency", "1",
                  "--loglevel", "INFO", "-n", f"{name}@%h"], env, log_path)
    try:
        wait_until(lambda: b" ready." in log_path.read_bytes(), timeout, "the Celery worker", every=0.5)
    except AssertionError:
        stop(proc)
        raise
    return proc


def other_sessions() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()")
        return cursor.fetchone()[0]


def wait_for_server_sessions_to_end(django_db_blocker, timeout: float = 20) -> None:
    """pytest-django drops the test database at the end: let the servers' sessions go first."""
    with django_db_blocker.unblock():
        deadline = time.monotonic() + timeout
        while other_sessions() and time.monotonic() < deadline:
            time.sleep(0.2)


def show_logs(*paths: Path, chars: int = 3000) -> None:
    for path in paths:
        if path.exists():
            print(f"--- {path.name} (tail)\n" + path.read_text(errors="replace")[-chars:])
