"""The platform briefly unreachable while an engine reports: the engine's Reporter
(workers/io/report.py) posts metrics and samples to a real daphne (a subprocess on the test
database); the server is stopped mid-run for a few seconds and started again on the same
port. Once it is back, every point and sample is stored exactly once: the Reporter kept
them buffered and retried with backoff, and ingest skips what it stored already (a batch
whose answer was lost to the shutdown is sent again)."""
import logging
import signal
import threading
import time

import pytest
from django.contrib.auth import get_user_model
from django.db.models import Count

from fluxrl.accounts.models import Membership, Role, Team
from fluxrl.accounts.services import create_run_token
from fluxrl.metrics.models import MetricPoint
from fluxrl.runs.models import Run
from fluxrl.runs.services import engine_spec
from tests.platform.servers import (
    free_port, needs_postgres, reachable, server_env, show_logs, start_daphne, stop, wait_for_server_sessions_to_end,
)
from workers.io.report import PlatformClient, Reporter

pytestmark = [pytest.mark.timeout(180), pytest.mark.django_db(transaction=True), needs_postgres]

KEYS = ["reward/mean", "loss/policy", "throughput/samples_per_s", "staleness/mean", "version/current"]
STEPS = 300
STEP_S = 0.03  # the whole run logs for ~9 s
OUTAGE_AT_STEP = 60
OUTAGE_S = 3.0


class Platform:
    """daphne on a fixed port that the test can take down and bring back."""

    def __init__(self, tmp_path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = server_env(tmp_path / "data", self.port)
        self.log = tmp_path / "daphne.log"
        self.proc = None

    def start(self):
        self.proc = start_daphne(self.env, self.port, self.log)

    def stop(self, sig=signal.SIGTERM):
        if sig == signal.SIGKILL:  # a crash: requests in flight may or may not have been stored
            self.proc.kill()
            self.proc.wait()
        else:
            stop(self.proc)


@pytest.fixture
def platform(django_db_setup, django_db_blocker, tmp_path):
    server = Platform(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        show_logs(server.log)
        wait_for_server_sessions_to_end(django_db_blocker)


@pytest.fixture
def run():
    user = get_user_model().objects.create(username="engine")
    team = Team.objects.create(name="Outage", slug="outage")
    Membership.objects.create(user=user, team=team, role=Role.ADMIN)
    spec = {"name": "outage", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"}}
    # Created directly, not submitted: no Celery worker is involved here.
    return Run.objects.create(team=team, owner=user, name="outage", spec=spec, resolved_spec=engine_spec(spec))


def train(reporter: Reporter, reached: dict[int, threading.Event]) -> None:
    """What the engine does: one point per key every step, a sample every 10 steps."""
    for step in range(STEPS):
        reporter.log(step, {key: step + i / 10 for i, key in enumerate(KEYS)})
        if step % 10 == 0:
            reporter.sample({"uid": f"s{step}", "step": step, "prompt": "12+30=", "completion": "42",
                             "reward": 1.0, "versions": [step, step], "length": 2})
        if step in reached:
            reached[step].set()
        time.sleep(STEP_S)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_metrics_reported_while_the_platform_restarts_are_stored_once_each(platform, run, tmp_path, caplog, sig):
    caplog.set_level(logging.INFO, logger="workers.io.report")  # "reachable again" is info
    client = PlatformClient(platform.url, create_run_token(run)[1], run.pk, timeout=5)
    reporter = Reporter(tmp_path / "metrics.jsonl", client, flush_every_s=0.2, max_backoff_s=2.0)
    reached = {OUTAGE_AT_STEP: threading.Event()}
    engine = threading.Thread(target=train, args=(reporter, reached))
    engine.start()
    try:
        assert reached[OUTAGE_AT_STEP].wait(30)
        platform.stop(sig)  # mid-run, possibly mid-request
        down_at = time.monotonic()
        time.sleep(OUTAGE_S)
        assert not reachable(platform.url)
        stored_while_down = MetricPoint.objects.filter(run=run).count()
        platform.start()  # same port
        outage = time.monotonic() - down_at
    finally:
        engine.join()
        reporter.close()

    assert reporter.failures > 0, "the Reporter never noticed the outage"
    assert reporter.pending == (0, 0) and reporter.dropped_points == 0
    assert 0 < stored_while_down < STEPS * len(KEYS), "the outage did not fall mid-run"
    counts = MetricPoint.objects.filter(run=run).values("key", "step").annotate(n=Count("id"))
    assert {(c["key"], c["step"]) for c in counts} == {(k, s) for k in KEYS for s in range(STEPS)}, "points lost"
    assert max(c["n"] for c in counts) == 1, "points duplicated"
    values = {(p.key, p.step): p.value for p in MetricPoint.objects.filter(run=run)}
    assert all(values[key, step] == step + i / 10 for i, key in enumerate(KEYS) for step in range(STEPS))
    assert sorted(run.samples.values_list("step", flat=True)) == list(range(0, STEPS, 10))
    err = caplog.text  # the Reporter's log (on stderr under the engine CLI: tests/workers/io/test_report.py)
    assert "cannot reach the platform" in err and "reachable again" in err
    print(f"platform down {outage:.1f} s (restart included); {reporter.failures} failed posts; "
          f"{stored_while_down} of {STEPS * len(KEYS)} points stored before it went down; all stored once")
