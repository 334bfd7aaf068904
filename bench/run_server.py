"""What bench/ingest.py and bench/ws_latency.py share: a real daphne on a fresh database
(tests/browser/liveserver.py: PostgreSQL when DATABASE_URL names one, else SQLite), one
run, its worker's run token and a team member's API token."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
from dashboard_load import django_against
from liveserver import REPO, LiveServer, free_port


@contextlib.contextmanager
def run_server(redis_url: str | None = None, **env: str):
    """Yields (server, run_id, run_key, user_key). redis_url: the server's channel layer
    (default: in-memory, the embedded setup); env: more settings for the server."""
    with tempfile.TemporaryDirectory() as workdir:
        server = LiveServer(Path(workdir))
        server.env.update(env, **({"REDIS_URL": redis_url} if redis_url else {}))
        if redis_url:  # the production default with Redis, not the browser tests' 1 s status poll
            server.env.pop("FLUXRL_WS_STATUS_POLL_S", None)
        with server:
            django_against(server)
            from django.contrib.auth import get_user_model

            from fluxrl.accounts.models import Membership, Role, Team
            from fluxrl.accounts.services import create_api_token, create_run_token
            from fluxrl.runs.models import Run
            from fluxrl.runs.services import engine_spec

            user = get_user_model().objects.create(username="bench")
            team = Team.objects.create(name="Bench", slug="bench")
            Membership.objects.create(user=user, team=team, role=Role.ADMIN)
            spec = {"name": "bench", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"}}
            # Created directly, not submitted: nothing is enqueued for a Celery worker.
            run = Run.objects.create(team=team, owner=user, name="bench", spec=spec, resolved_spec=engine_spec(spec))
            yield server, run.pk, create_run_token(run)[1], create_api_token(user, "bench")[1]


@contextlib.contextmanager
def more_servers(server: LiveServer, count: int):
    """count more daphne processes like server's (same database, data folder, channel
    layer), as a web tier of several processes behind a load balancer; yields their URLs."""
    processes, urls = [], []
    try:
        for _ in range(count):
            port = free_port()
            with open(server.workdir / f"daphne-{port}.log", "wb") as log:
                processes.append(subprocess.Popen(
                    [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "fluxrl.asgi:application"],
                    env=server.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            deadline = time.monotonic() + 60
            while True:
                try:
                    requests.get(f"{url}/api/me/", timeout=2)
                    break
                except requests.ConnectionError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"daphne at {url} did not start") from None
                    time.sleep(0.3)
        yield urls
    finally:
        for process in processes:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(10)
