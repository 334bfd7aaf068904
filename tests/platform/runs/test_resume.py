"""Resuming a run from the platform (POST /api/runs/<id>/resume/, `fluxrl resume`): only a
failed or cancelled run with a checkpoint is queued again; the dispatcher then starts the
engine with --resume on the same output folder (the stand-in engine, fake_engine.py,
records its arguments). tests/workers/coord/test_resume.py resumes the real engine."""
import json
import sys
from pathlib import Path

import pytest

from fluxrl.metrics.models import MetricPoint
from fluxrl.metrics.services import ingest_points
from fluxrl.runs import dispatch, services
from fluxrl.runs.models import Run, RunStatus
from fluxrl.runs.lifecycle import resume_from_checkpoint
from fluxrl.runs.services import add_checkpoint, add_samples, transition

FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")


@pytest.fixture
def queued(monkeypatch):
    """The runs resume_run hands to Celery (once the transaction commits)."""
    sent = []
    monkeypatch.setattr(services, "enqueue_run", lambda run: sent.append(run.pk))
    return sent


def ended(run, status=RunStatus.FAILED, reason="The engine was killed by SIGKILL."):
    run = transition(transition(run, RunStatus.STARTING, worker_host="h", worker_pid=1), RunStatus.RUNNING)
    return transition(run, status, failure_reason=reason)


@pytest.mark.parametrize("status", ["queued", "starting", "running", "succeeded"])
def test_only_a_failed_or_cancelled_run_can_be_resumed(api_a, run_a, status, assert_error, queued):
    for step in {"queued": [], "starting": ["starting"], "running": ["starting", "running"],
                 "succeeded": ["starting", "running", "succeeded"]}[status]:
        run_a = transition(run_a, step)
    add_checkpoint(run_a, 2, 2, "/data/runs/1/out/checkpoints/step-2")
    error = assert_error(api_a.post(f"/api/runs/{run_a.id}/resume/"), 409, "illegal_transition", field="status")
    assert error["message"] == f"Only a failed or cancelled run can be resumed; run {run_a.id} is {status}."
    assert Run.objects.get(pk=run_a.pk).status == status and queued == []


def test_a_run_without_a_checkpoint_cannot_be_resumed(api_a, run_a, assert_error, queued):
    run = ended(run_a)
    error = assert_error(api_a.post(f"/api/runs/{run.id}/resume/"), 409, "no_checkpoint")
    assert "no checkpoint to resume from" in error["message"] and "trainer.checkpoint_every" in error["message"]
    assert Run.objects.get(pk=run.pk).status == "failed" and queued == []


@pytest.mark.parametrize("status", [RunStatus.FAILED, RunStatus.CANCELLED])
def test_a_failed_or_cancelled_run_with_a_checkpoint_is_queued_again(
        api_bob, run_a, status, worker_client, queued, django_capture_on_commit_callbacks):
    worker = worker_client(run_a)
    run = transition(transition(run_a, RunStatus.STARTING), RunStatus.RUNNING)
    assert worker.post(f"/api/runs/{run.id}/checkpoints/", {"step": 2, "version": 2, "path": "ckpt/step-2"},
                       format="json").status_code == 201
    add_checkpoint(run, 4, 4, "ckpt/step-4")
    ingest_points(run, [{"key": "reward/mean", "step": s, "value": s / 10, "time": 1.0} for s in range(1, 7)])
    add_samples(run, [{"step": s, "prompt": "1+1=", "completion": "2", "reward": 1.0, "versions": [s], "uid": f"u{s}"}
                      for s in range(1, 7)])
    if status == RunStatus.CANCELLED:
        run.cancel_requested = True
        run.save()
    run = transition(run, status, failure_reason="lost")

    with django_capture_on_commit_callbacks(execute=True):
        response = api_bob.post(f"/api/runs/{run.id}/resume/")  # any member of the team
    assert response.status_code == 200, response.content
    assert (response.json()["status"], response.json()["cancel_requested"]) == ("queued", False)
    run.refresh_from_db()
    assert (run.status, run.failure_reason, run.finished_at, run.cancel_requested) == ("queued", "", None, False)
    assert queued == [run.pk]
    # Nothing is dropped yet: the engine says which step it resumes from as it starts
    # running (tests/platform/runs/test_resume_sync.py), and the points after it go then.
    assert sorted(MetricPoint.objects.filter(run=run).values_list("step", flat=True)) == [1, 2, 3, 4, 5, 6]
    assert sorted(run.samples.values_list("step", flat=True)) == [1, 2, 3, 4, 5, 6]
    assert resume_from_checkpoint(run)


def test_another_teams_run_cannot_be_resumed(api_b, run_a, assert_error, queued):
    run = ended(run_a)
    add_checkpoint(run, 2, 2, "ckpt/step-2")
    assert_error(api_b.post(f"/api/runs/{run.id}/resume/"), 404)
    assert Run.objects.get(pk=run.pk).status == "failed"


def test_a_run_token_cannot_resume_its_run(run_a, worker_client, queued):
    worker = worker_client(run_a)
    run = ended(run_a)
    add_checkpoint(run, 2, 2, "ckpt/step-2")
    assert worker.post(f"/api/runs/{run.id}/resume/").status_code in (401, 403)
    assert Run.objects.get(pk=run.pk).status == "failed"


@pytest.mark.django_db(transaction=True)
def test_the_dispatcher_resumes_the_engine_on_the_same_output_folder(run_a, settings, monkeypatch):
    settings.FLUXRL_ENGINE_COMMAND = [sys.executable, str(FAKE_ENGINE)]
    settings.FLUXRL_PUBLIC_URL = "http://platform.example:8000"
    monkeypatch.setattr(services, "enqueue_run", lambda run: None)
    out = dispatch.run_dir(run_a.pk) / "out"

    monkeypatch.setenv("FAKE_ENGINE_MODE", "fail")
    assert dispatch.execute_run(run_a.pk) == "failed"
    first = json.loads((out / "call.json").read_text())["argv"]
    assert "--resume" not in first

    add_checkpoint(run_a, 2, 2, str(out / "checkpoints" / "step-2"))
    services.resume_run(run_a)
    monkeypatch.setenv("FAKE_ENGINE_MODE", "ok")
    assert dispatch.execute_run(run_a.pk) == "succeeded"
    again = json.loads((out / "call.json").read_text())["argv"]
    assert again == first + ["--resume"]  # same spec file, same --out, same run id
    run = Run.objects.get(pk=run_a.pk)
    assert run.status == "succeeded" and not run.failure_reason


@pytest.mark.django_db(transaction=True)  # the live server runs in another thread
def test_fluxrl_resume(live_server, alice, run_a, tmp_path, monkeypatch, capsys):
    from fluxrl.accounts.services import create_api_token
    from workers.cli.fluxrl import main

    monkeypatch.setattr(services, "enqueue_run", lambda run: None)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    for name in ("FLUXRL_URL", "FLUXRL_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    assert main(["login", "--url", live_server.url, "--token", create_api_token(alice, "cli")[1]]) == 0
    run = ended(run_a)
    capsys.readouterr()

    assert main(["resume", str(run.pk)]) == 2
    assert "no checkpoint to resume from" in capsys.readouterr().err
    add_checkpoint(run, 2, 2, "ckpt/step-2")
    assert main(["resume", str(run.pk)]) == 0
    assert capsys.readouterr().out.strip() == f"run {run.pk}: queued again, to resume from its newest checkpoint (queued)"
    assert main(["resume", str(run.pk)]) == 2
    assert f"run {run.pk} is queued. (409 illegal_transition)" in capsys.readouterr().err
