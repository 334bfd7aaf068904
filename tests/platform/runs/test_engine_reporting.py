"""An engine reporting to the platform on its own (started by hand, not by the Celery
dispatcher): its token from the environment, and its heartbeat, against a real server."""
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from fluxrl.accounts.services import create_run_token
from fluxrl.runs.dispatch import reap_stale_runs
from fluxrl.runs.models import Run, RunStatus
from fluxrl.runs.services import cancel_run, transition
from workers.io.heartbeat import Heartbeat
from workers.io.report import PlatformClient

pytestmark = pytest.mark.django_db(transaction=True)


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def running(run) -> Run:
    transition(run, RunStatus.STARTING)
    return transition(run, RunStatus.RUNNING)


def test_the_engine_takes_its_run_token_from_the_environment(live_server, run_a, tmp_path):
    (tmp_path / "bad.yaml").write_text("name: x\nmodel: {path: builtin:tiny}\nnot_a_section: 1\n")
    _, key = create_run_token(run_a)
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"} | {"FLUXRL_RUN_TOKEN": key}
    done = subprocess.run([sys.executable, "-m", "workers", "run", str(tmp_path / "bad.yaml"), "--out", str(tmp_path / "out"),
                           "--platform", live_server.url, "--run-id", str(run_a.pk)],
                          cwd=settings.REPO_DIR, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    run = Run.objects.get(pk=run_a.pk)  # the failure was reported with the token
    assert run.status == RunStatus.FAILED and "not_a_section" in run.failure_reason


def test_a_heartbeat_keeps_a_long_step_alive_for_the_reaper_and_hears_a_cancel(live_server, run_a, settings, reaper_in_contact):
    settings.FLUXRL_RUN_STALE_S = 60
    running(run_a)
    Run.objects.filter(pk=run_a.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=120))  # a long step so far
    _, key = create_run_token(run_a)
    cancelled = threading.Event()
    heartbeat = Heartbeat(PlatformClient(live_server.url, key, run_a.pk), every_s=0.2, on_cancel=cancelled.set).start()
    try:
        wait_until(lambda: Run.objects.get(pk=run_a.pk).heartbeat_at > timezone.now() - timedelta(seconds=5))
        assert reap_stale_runs() == [] and Run.objects.get(pk=run_a.pk).status == RunStatus.RUNNING
        cancel_run(run_a)
        assert cancelled.wait(10) and heartbeat.cancelled
        transition(run_a, RunStatus.CANCELLED)  # the run ended: its token stops working, the heartbeat stops
        heartbeat._thread.join(10)
        assert not heartbeat._thread.is_alive()
    finally:
        heartbeat.stop()


def test_without_a_heartbeat_the_reaper_fails_a_run_whose_engine_went_quiet(run_a, settings, reaper_in_contact):
    settings.FLUXRL_RUN_STALE_S = 60
    running(run_a)
    Run.objects.filter(pk=run_a.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=120))
    assert reap_stale_runs() == [run_a.pk]
