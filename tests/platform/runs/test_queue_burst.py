"""Twenty runs submitted at once to a queue with one slot: a real Celery worker
(--concurrency 1) on Redis, PostgreSQL, runs submitted through the REST API of a real
daphne. The engine is the stand-in (fake_engine.py, a 0.3 s run each): the subject is
dispatch. They must run one at a time, in the order they were submitted, each exactly
once, and all succeed."""
import json
import sys
import threading
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.db import connection

from fluxrl.accounts.models import Membership, Role, Team
from fluxrl.accounts.services import create_api_token
from fluxrl.runs.models import Run, RunStatus
from tests.platform.servers import (
    free_port, needs_postgres_and_redis, server_env, show_logs, start_celery_worker, start_daphne, stop, wait_until,
    wait_for_server_sessions_to_end,
)
from workers.io.client import FluxClient

pytestmark = [pytest.mark.timeout(180), pytest.mark.django_db(transaction=True), needs_postgres_and_redis]

RUNS = 20
ENGINE_SECONDS = 0.3
FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")
SPEC = """\
name: burst-{i}
model: {{path: "builtin:tiny"}}
task: {{dataset: "gen:add"}}
resources: {{queue: cpu}}
"""


@pytest.fixture
def one_slot_queue(django_db_setup, django_db_blocker, tmp_path):
    """daphne and one Celery worker with one slot on the cpu queue (of the servers' own Redis
    database); yields the server's URL and data folder."""
    port = free_port()
    env = server_env(tmp_path / "data", port, FLUXRL_ENGINE_COMMAND=f"{sys.executable} {FAKE_ENGINE}",
                     FAKE_ENGINE_MODE="slow", FAKE_ENGINE_SECONDS=str(ENGINE_SECONDS))
    logs = tmp_path / "daphne.log", tmp_path / "celery.log"
    web = start_daphne(env, port, logs[0])
    try:
        worker = start_celery_worker(env, "cpu", f"burst-{port}", logs[1])
        try:
            yield f"http://127.0.0.1:{port}", tmp_path / "data"
        finally:
            stop(worker)
    finally:
        stop(web)
        show_logs(*logs)
        wait_for_server_sessions_to_end(django_db_blocker)


def watch_concurrency(ids: list[int], stop_event: threading.Event, seen: list[int]) -> None:
    """Record how many of the runs are live (starting/running) at once, every 50 ms."""
    try:
        while not stop_event.wait(0.05):
            seen.append(Run.objects.filter(pk__in=ids, status__in=[RunStatus.STARTING, RunStatus.RUNNING]).count())
    finally:
        connection.close()  # this thread's own session, or the test database cannot be dropped


def test_twenty_runs_on_a_one_slot_queue_run_one_by_one_in_submission_order(one_slot_queue):
    url, data = one_slot_queue
    user = get_user_model().objects.create(username="burst")
    Membership.objects.create(user=user, team=Team.objects.create(name="Burst", slug="burst"), role=Role.ADMIN)
    client = FluxClient(url, create_api_token(user, "burst")[1])

    ids = [client.submit(SPEC.format(i=i))["id"] for i in range(RUNS)]  # back to back, ~1 s for all
    assert ids == sorted(ids)
    stop_event, live_counts = threading.Event(), []
    watcher = threading.Thread(target=watch_concurrency, args=(ids, stop_event, live_counts))
    watcher.start()
    try:
        wait_until(lambda: all(r.is_terminal for r in Run.objects.filter(pk__in=ids)), 120, "every run to end", every=0.5)
    finally:
        stop_event.set()
        watcher.join()

    runs = {r.pk: r for r in Run.objects.filter(pk__in=ids)}
    assert {pk: r.status for pk, r in runs.items()} == dict.fromkeys(ids, RunStatus.SUCCEEDED), \
        {pk: r.failure_reason for pk, r in runs.items() if r.failure_reason}
    assert max(live_counts) == 1, "two runs were live at once on a one-slot queue"

    spans = []
    for pk in ids:
        out = data / "runs" / str(pk) / "out"
        log = (data / "runs" / str(pk) / "engine.log").read_text()
        assert log.count("engine: starting") == 1, f"run {pk}'s engine was started {log.count('engine: starting')} times"
        spans.append((json.loads((out / "call.json").read_text())["started"], float((out / "ended").read_text())))
    # One by one, in submission order: each engine starts after the previous one ended.
    for (pk, (_, ended)), (next_pk, (started, _)) in zip(zip(ids, spans), zip(ids[1:], spans[1:])):
        assert started >= ended, f"run {next_pk} started {ended - started:.3f} s before run {pk} ended"
    # The database agrees: finished in submission order.
    finished = [runs[pk].finished_at for pk in ids]
    assert finished == sorted(finished)
    print(f"{RUNS} runs in {spans[-1][1] - spans[0][0]:.1f} s, first start to last end "
          f"({(spans[-1][1] - spans[0][0]) / RUNS:.2f} s a run, {ENGINE_SECONDS} s of it the engine)")
