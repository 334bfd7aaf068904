"""Dispatch with real processes: a stand-in engine (fake_engine.py) is started, watched,
cancelled and killed the way the real one is (test_dispatch_engine.py runs the real one).

The database is transactional: the watcher calls close_old_connections(), as a long
Celery task must, and that would end a test wrapped in one transaction."""
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from fluxrl.accounts.models import RunToken
from fluxrl.accounts.services import hash_key
from fluxrl.celery import app as celery_app
from fluxrl.runs import dispatch
from fluxrl.runs.models import Run, RunStatus
from fluxrl.runs.engine_inputs import resolve_spec
from fluxrl.runs.services import cancel_run, submit_run, transition
from workers.spec import resolved_document

psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.django_db(transaction=True)

FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")


@pytest.fixture
def engine(settings, monkeypatch):
    """Choose what the stand-in engine does; returns a function mode -> None."""
    settings.FLUXRL_ENGINE_COMMAND = [sys.executable, str(FAKE_ENGINE)]
    settings.FLUXRL_CANCEL_GRACE_S = 1.0
    settings.FLUXRL_PUBLIC_URL = "http://platform.example:8000"
    return lambda mode: monkeypatch.setenv("FAKE_ENGINE_MODE", mode)


def out_dir(run) -> Path:
    return dispatch.run_dir(run.pk) / "out"


def group_processes(pgid: int) -> list:
    return [p for p in psutil.process_iter(["status"]) if _pgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(path: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_submitting_enqueues_the_run_on_the_queue_its_spec_names(team_a, alice, spec):
    run = submit_run(team_a, alice, spec(resources={"queue": "gpu"}))
    with celery_app.connection_for_read() as connection:  # the test broker (conftest)
        message = connection.SimpleQueue("gpu").get(timeout=2)
    assert message.headers["task"] == "fluxrl.runs.tasks.execute_run"
    assert message.payload[0] == [run.pk]
    message.ack()


def test_an_engine_that_exits_0_succeeds_the_run(run_a, engine):
    engine("ok")
    assert dispatch.execute_run(run_a.pk) == "succeeded"
    run = Run.objects.get(pk=run_a.pk)
    assert (run.status, run.worker_host) == ("succeeded", os.uname().nodename) and run.worker_pid
    assert not RunToken.objects.filter(run=run, revoked_at__isnull=True).exists()

    folder = dispatch.run_dir(run.pk)
    assert json.loads((folder / "spec.json").read_text()) == resolved_document(resolve_spec(run))
    call = json.loads((out_dir(run) / "call.json").read_text())
    argv = call["argv"]
    assert argv[:2] == ["run", str(folder / "spec.json")] and "--no-progress" in argv
    assert argv[argv.index("--platform") + 1] == "http://platform.example:8000"
    assert argv[argv.index("--run-id") + 1] == str(run.pk)
    # The run token is in the environment, not on the command line that ps shows.
    assert "--token" not in argv and not any(a.startswith("flxr_") for a in argv)
    assert RunToken.objects.filter(run=run, key_hash=hash_key(call["run_token"])).exists()
    assert call["pgid"] == call["pid"] == run.worker_pid  # its own process group
    assert "DATABASE_URL" not in call["env"] and "DJANGO_SECRET_KEY" not in call["env"]
    assert "engine: starting" in (folder / "engine.log").read_text()


def test_an_engine_that_fails_fails_the_run_with_the_end_of_its_log(run_a, engine):
    engine("fail")
    assert dispatch.execute_run(run_a.pk) == "failed"
    reason = Run.objects.get(pk=run_a.pk).failure_reason
    assert reason.startswith("The engine exited with code 3. Last lines of its log:\n")
    assert reason.endswith("loading the model: done\nerror: the dataset is empty")  # \r-rewritten line: last state


def test_a_killed_engine_fails_the_run_and_leaves_no_process(run_a, engine):
    engine("crash")
    assert dispatch.execute_run(run_a.pk) == "failed"
    run = Run.objects.get(pk=run_a.pk)
    assert run.failure_reason.startswith("The engine was killed by SIGKILL.")
    child = int((out_dir(run) / "child.pid").read_text())
    assert gone(child) and gone(run.worker_pid) and not group_processes(run.worker_pid)


def test_cancel_stops_the_whole_group_even_if_it_ignores_sigterm(run_a, engine):
    engine("stubborn")
    proc, log_path = dispatch.launch(run_a.pk)
    wait_for(out_dir(run_a) / "ready")
    child = int((out_dir(run_a) / "child.pid").read_text())
    assert {p.pid for p in group_processes(proc.pid)} == {proc.pid, child}
    beat = Run.objects.get(pk=run_a.pk).heartbeat_at

    run = cancel_run(run_a)
    assert (run.status, run.cancel_requested) == ("starting", True)  # the watcher finishes it
    started = time.monotonic()
    assert dispatch.watch(run_a.pk, proc) is None
    assert dispatch.finish(run_a.pk, None, log_path) == "cancelled"
    assert time.monotonic() - started < 5  # 1 s poll + 1 s grace, then SIGKILL
    assert gone(proc.pid) and gone(child) and not group_processes(proc.pid)
    assert Run.objects.get(pk=run_a.pk).heartbeat_at > beat


def test_a_run_cancelled_while_queued_is_never_started(run_a, engine):
    engine("ok")
    cancel_run(run_a)
    assert dispatch.execute_run(run_a.pk) == "skipped"
    assert not dispatch.run_dir(run_a.pk).exists()


def test_a_redelivered_task_does_not_start_the_run_again(run_a, engine):
    engine("ok")
    transition(run_a, RunStatus.STARTING, worker_host="other-host")
    assert dispatch.execute_run(run_a.pk) == "skipped"
    assert Run.objects.get(pk=run_a.pk).status == "starting"


def test_a_run_whose_model_reference_no_longer_resolves_fails_at_dispatch(run_a, engine):
    engine("ok")  # a spec stored before a rule: its model reference is checked again at dispatch
    Run.objects.filter(pk=run_a.pk).update(spec=dict(run_a.spec, model={"path": "/etc"}))
    assert dispatch.execute_run(run_a.pk) == "failed"
    assert Run.objects.get(pk=run_a.pk).failure_reason.startswith("Could not start the engine: spec.model.path")


def test_a_failure_reported_without_reason_gets_the_log_tail(run_a, tmp_path):
    log_path = tmp_path / "engine.log"
    log_path.write_text("step 1\nTraceback: boom\n")
    transition(transition(transition(run_a, RunStatus.STARTING), RunStatus.RUNNING), RunStatus.FAILED)
    assert dispatch.finish(run_a.pk, 1, log_path) == "failed"
    assert Run.objects.get(pk=run_a.pk).failure_reason.endswith("step 1\nTraceback: boom")


def test_the_reaper_fails_live_runs_whose_heartbeat_is_stale(team_a, alice, spec, settings, reaper_in_contact):
    settings.FLUXRL_RUN_STALE_S = 60
    old = timezone.now() - timedelta(seconds=61)
    lost, alive, waiting = (submit_run(team_a, alice, spec(name=name)) for name in ("lost", "alive", "waiting"))
    for run in (lost, alive):
        transition(transition(run, RunStatus.STARTING, worker_host="gpu-7", worker_pid=4242), RunStatus.RUNNING)
    Run.objects.filter(pk__in=[lost.pk, waiting.pk]).update(heartbeat_at=old, updated_at=old)

    assert dispatch.reap_stale_runs() == [lost.pk]
    lost.refresh_from_db()
    assert lost.status == "failed" and "no heartbeat for more than 60 s" in lost.failure_reason and "gpu-7" in lost.failure_reason
    assert Run.objects.get(pk=alive.pk).status == "running" and Run.objects.get(pk=waiting.pk).status == "queued"
    assert dispatch.reap_stale_runs() == []


def test_a_failure_reported_after_a_cancel_request_is_a_cancel(run_a):
    # An engine stopped during start-up may report the interruption as a failure.
    run = cancel_run(transition(run_a, RunStatus.STARTING))
    assert transition(run, RunStatus.FAILED, failure_reason="KeyboardInterrupt").status == "cancelled"


# -- runs over several nodes: one task per node ---------------------------------------------
def test_a_run_over_two_nodes_is_enqueued_as_one_task_per_node(team_a, alice, spec):
    run = submit_run(team_a, alice, spec(resources={"queue": "gpu", "nodes": 2, "trainer_ranks": 2}))
    with celery_app.connection_for_read() as connection:
        queue = connection.SimpleQueue("gpu")
        messages = [queue.get(timeout=2), queue.get(timeout=2)]
    tasks = sorted((m.headers["task"], m.payload[0]) for m in messages)
    assert tasks == [("fluxrl.runs.tasks.execute_run", [run.pk]), ("fluxrl.runs.tasks.join_run", [run.pk, 1])]
    for m in messages:
        m.ack()


@pytest.fixture
def two_node_run(team_a, alice, spec, engine, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_NODE_OUT", str(tmp_path))
    return submit_run(team_a, alice, spec(resources={"nodes": 2, "trainer_ranks": 2}))


def _in_thread(fn, *args):
    import threading

    box = {}
    thread = threading.Thread(target=lambda: box.update(result=fn(*args)))
    thread.start()
    return thread, box


def test_the_node_task_joins_node_0s_rendezvous_with_the_runs_key_and_ends_with_the_run(
        two_node_run, engine, tmp_path, monkeypatch):
    engine("slow")
    monkeypatch.setenv("FAKE_ENGINE_SECONDS", "3")
    node_thread, node = _in_thread(dispatch.join_run, two_node_run.pk, 1)  # may start first: it waits
    assert dispatch.execute_run(two_node_run.pk) == "succeeded"
    node_thread.join(30)
    assert node["result"] == "done"
    call = json.loads((out_dir(two_node_run) / "call.json").read_text())
    joined = json.loads((tmp_path / "node-1.json").read_text())
    rendezvous = call["argv"][call["argv"].index("--rendezvous") + 1]
    assert joined["argv"][:5] == ["node", "--rendezvous", rendezvous, "--node-rank", "1"]
    assert Run.objects.get(pk=two_node_run.pk).rendezvous == rendezvous
    # both hold the same per-run key, which is in neither command line
    assert call["key_sha"] and call["key_sha"] == joined["key_sha"]
    assert not any(len(a) == 64 for a in call["argv"] + joined["argv"])
    assert "DJANGO_SECRET_KEY" not in joined["env"] and "FLUXRL_RUN_TOKEN" not in joined["env"]
    assert gone(joined["pid"]) and not group_processes(joined["pgid"])  # stopped once the run ended


def test_a_node_whose_agent_fails_fails_the_whole_run(two_node_run, engine, monkeypatch, tmp_path):
    engine("stubborn")  # node 0 would run on forever
    monkeypatch.setenv("FAKE_NODE_MODE", "fail")
    coordinator, result = _in_thread(dispatch.execute_run, two_node_run.pk)
    assert dispatch.join_run(two_node_run.pk, 1) == "failed"
    coordinator.join(30)
    run = Run.objects.get(pk=two_node_run.pk)
    assert run.status == "failed" and result["result"] == "failed"
    assert run.failure_reason.startswith("Node 1's agent exited with code 3. Last lines of its log:")
    assert "could not start its trainer rank" in run.failure_reason
    assert gone(run.worker_pid) and not group_processes(run.worker_pid)  # node 0's engine was stopped too


def test_a_node_task_of_a_finished_run_starts_nothing(run_a, engine, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_NODE_OUT", str(tmp_path))
    cancel_run(run_a)
    assert dispatch.join_run(run_a.pk, 1) == "skipped" and not (tmp_path / "node-1.json").exists()
