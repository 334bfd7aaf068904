import pytest

from fluxrl.accounts.models import RunToken
from fluxrl.runs.models import Run, RunStatus
from fluxrl.runs.services import IllegalTransition, cancel_run, transition


def test_a_run_goes_from_queued_to_succeeded_with_timestamps(run_a):
    assert (run_a.status, run_a.started_at, run_a.finished_at) == ("queued", None, None)
    run = transition(run_a, RunStatus.STARTING, worker_host="gpu-1", worker_pid=42)
    assert run.started_at is None and run.heartbeat_at is not None and run.worker_host == "gpu-1"
    run = transition(run, RunStatus.RUNNING)
    assert run.started_at is not None
    run = transition(run, RunStatus.SUCCEEDED)
    assert run.finished_at >= run.started_at and run.status == "succeeded"


@pytest.mark.parametrize(
    "path, illegal",
    [
        ([], RunStatus.RUNNING),
        ([], RunStatus.SUCCEEDED),
        ([RunStatus.STARTING], RunStatus.QUEUED),
        ([RunStatus.STARTING, RunStatus.RUNNING, RunStatus.SUCCEEDED], RunStatus.FAILED),
        ([RunStatus.CANCELLED], RunStatus.STARTING),
    ],
)
def test_illegal_transitions_raise(run_a, path, illegal):
    for status in path:
        run_a = transition(run_a, status)
    with pytest.raises(IllegalTransition):
        transition(run_a, illegal)
    run_a.refresh_from_db()
    assert run_a.status == (path[-1] if path else "queued")


def test_failure_keeps_its_reason(run_a):
    run = transition(transition(run_a, RunStatus.STARTING), RunStatus.FAILED, failure_reason="CUDA OOM")
    assert (run.status, run.failure_reason) == ("failed", "CUDA OOM")


def test_worker_reports_status_and_heartbeats_with_its_run_token(run_a, worker_client):
    worker = worker_client(run_a)
    started = worker.post(f"/api/runs/{run_a.id}/status/", {"status": "starting", "worker_host": "h", "worker_pid": 7})
    assert started.status_code == 200 and started.json()["status"] == "starting"
    first_beat = started.json()["heartbeat_at"]
    again = worker.post(f"/api/runs/{run_a.id}/status/", {"status": "starting"})
    assert again.json()["heartbeat_at"] >= first_beat and again.json()["cancel_requested"] is False


def test_illegal_transition_over_the_api_is_409(run_a, worker_client, assert_error):
    error = assert_error(worker_client(run_a).post(f"/api/runs/{run_a.id}/status/", {"status": "succeeded"}),
                         409, "illegal_transition", field="status")
    assert "queued" in error["message"]


def test_cancelling_a_queued_run_cancels_it_at_once(api_a, run_a):
    body = api_a.post(f"/api/runs/{run_a.id}/cancel/").json()
    assert (body["status"], body["cancel_requested"]) == ("cancelled", True) and body["finished_at"]


def test_cancelling_a_running_run_asks_its_worker_to_stop(api_a, run_a, worker_client):
    worker = worker_client(run_a)
    for status in ("starting", "running"):
        worker.post(f"/api/runs/{run_a.id}/status/", {"status": status})
    body = api_a.post(f"/api/runs/{run_a.id}/cancel/").json()
    assert (body["status"], body["cancel_requested"]) == ("running", True)
    beat = worker.post(f"/api/runs/{run_a.id}/status/", {"status": "running"}).json()
    assert beat["cancel_requested"] is True
    assert worker.post(f"/api/runs/{run_a.id}/status/", {"status": "cancelled"}).json()["status"] == "cancelled"


def test_cancelling_a_finished_run_is_409(api_a, run_a, assert_error):
    cancel_run(run_a)
    assert_error(api_a.post(f"/api/runs/{run_a.id}/cancel/"), 409, "illegal_transition")


def test_run_token_stops_working_when_the_run_ends(run_a, worker_client, assert_error):
    worker = worker_client(run_a)
    worker.post(f"/api/runs/{run_a.id}/status/", {"status": "starting"})
    worker.post(f"/api/runs/{run_a.id}/status/", {"status": "failed", "failure_reason": "boom"})
    assert RunToken.objects.filter(run=run_a, revoked_at__isnull=True).count() == 0
    assert_error(worker.post(f"/api/runs/{run_a.id}/metrics/", {"points": []}), 401)


@pytest.mark.parametrize("end", ["succeeded", "failed", "cancelled"])
def test_a_run_token_is_refused_everywhere_once_its_run_ends_saying_so(run_a, worker_client, assert_error, end):
    worker = worker_client(run_a)
    worker.post(f"/api/runs/{run_a.id}/status/", {"status": "starting"})
    worker.post(f"/api/runs/{run_a.id}/status/", {"status": "running"})
    if end == "cancelled":
        cancel_run(run_a)
    worker.post(f"/api/runs/{run_a.id}/status/", {"status": end})
    reports = [("metrics", {"points": [{"key": "reward/mean", "step": 1, "value": 0.5}]}),
               ("samples", {"samples": [{"step": 1, "prompt": "p", "completion": "c"}]}),
               ("checkpoints", {"step": 1, "version": 1, "path": "/ck/1"}), ("status", {"status": "running"})]
    for what, body in reports:
        response = worker.post(f"/api/runs/{run_a.id}/{what}/", body)
        assert_error(response, 401, "authentication_failed")
        assert response.json()["error"]["message"] == f"Run {run_a.id} has {end}: its run token takes no more reports."


def test_a_run_token_is_refused_as_soon_as_its_run_ends_even_before_revocation(run_a, worker_client, assert_error):
    worker = worker_client(run_a)
    Run.objects.filter(pk=run_a.pk).update(status="failed")  # ended, tokens not yet revoked
    assert RunToken.objects.filter(run=run_a, revoked_at__isnull=True).exists()
    assert_error(worker.post(f"/api/runs/{run_a.id}/metrics/", {"points": []}), 401, "authentication_failed")


def test_run_token_cannot_touch_another_run_or_user_endpoints(run_a, team_a, alice, spec, worker_client, assert_error):
    from fluxrl.runs.services import submit_run

    other = submit_run(team_a, alice, spec(name="other"))
    worker = worker_client(run_a)
    point = {"points": [{"key": "reward/mean", "step": 1, "value": 0.5}]}
    assert_error(worker.post(f"/api/runs/{other.id}/metrics/", point), 403, "permission_denied")
    assert_error(worker.post(f"/api/runs/{other.id}/status/", {"status": "starting"}), 403)
    assert_error(worker.post(f"/api/runs/{other.id}/samples/", {"samples": []}), 403)
    assert_error(worker.post(f"/api/runs/{other.id}/checkpoints/", {"step": 1, "version": 1, "path": "/x"}), 403)
    assert_error(worker.get(f"/api/runs/{other.id}/metrics/"), 403)
    assert not other.metric_points.exists() and Run.objects.get(pk=other.pk).status == "queued"
    assert_error(worker.get("/api/runs/"), 403)
    assert_error(worker.get(f"/api/runs/{run_a.id}/"), 403)
    assert_error(worker.post(f"/api/runs/{run_a.id}/cancel/"), 403)


def test_team_user_with_write_scope_may_report_but_read_scope_may_not(run_a, alice, client_for, assert_error):
    assert client_for(alice).post(f"/api/runs/{run_a.id}/status/", {"status": "starting"}).status_code == 200
    reader = client_for(alice, scopes=["read"])
    assert reader.get(f"/api/runs/{run_a.id}/status/").json()["status"] == "starting"
    assert_error(reader.post(f"/api/runs/{run_a.id}/status/", {"status": "running"}), 403)


def test_other_team_cannot_report_to_a_run(api_b, run_a, assert_error):
    assert_error(api_b.post(f"/api/runs/{run_a.id}/status/", {"status": "starting"}), 404)
    assert_error(api_b.get(f"/api/runs/{run_a.id}/samples/"), 404)


def test_run_tokens_are_created_over_the_api_for_live_runs_only(api_a, run_a, assert_error):
    created = api_a.post(f"/api/runs/{run_a.id}/tokens/")
    assert created.status_code == 201 and created.json()["key"].startswith("flxr_")
    cancel_run(run_a)
    assert_error(api_a.post(f"/api/runs/{run_a.id}/tokens/"), 409)


def test_samples_are_stored_once_with_versions_compressed(run_a, worker_client, api_a, assert_error):
    worker = worker_client(run_a)
    batch = {"samples": [
        {"uid": "s1", "step": 3, "prompt": "1+1=", "completion": "2", "reward": 1.0, "versions": [4, 4, 5]},
        {"step": 4, "prompt": "2+2=", "completion": "5", "reward": 0.0, "versions": [5], "error": ""},
    ]}
    assert worker.post(f"/api/runs/{run_a.id}/samples/", batch).status_code == 201
    worker.post(f"/api/runs/{run_a.id}/samples/", {"samples": batch["samples"][:1]})  # retried
    stored = api_a.get(f"/api/runs/{run_a.id}/samples/").json()["results"]
    assert [(s["uid"], s["version_runs"], s["length"]) for s in stored] == [("s1", [[4, 2], [5, 1]], 3), (None, [[5, 1]], 1)]
    assert [s["step"] for s in api_a.get(f"/api/runs/{run_a.id}/samples/", {"since_step": 3}).json()["results"]] == [4]
    assert_error(worker.post(f"/api/runs/{run_a.id}/samples/", {"samples": [{"step": -1}]}), 400, field="samples.0.step")
    huge = {"step": 1, "prompt": "p", "completion": "c", "versions": [2**40]}
    assert_error(worker.post(f"/api/runs/{run_a.id}/samples/", {"samples": [huge]}), 400, field="samples.0.versions.0")


def test_checkpoints_are_recorded_once_per_step(run_a, worker_client, api_a):
    worker = worker_client(run_a)
    first = worker.post(f"/api/runs/{run_a.id}/checkpoints/", {"step": 10, "version": 10, "path": "/ck/10"})
    assert first.status_code == 201
    worker.post(f"/api/runs/{run_a.id}/checkpoints/", {"step": 10, "version": 10, "path": "/ck/10-retry"})
    assert [(c["step"], c["path"]) for c in api_a.get(f"/api/runs/{run_a.id}/checkpoints/").json()["results"]] == [(10, "/ck/10")]


def test_expired_run_token_is_401(run_a, assert_error):
    from rest_framework.test import APIClient

    from fluxrl.accounts.services import create_run_token

    _, key = create_run_token(run_a, ttl_hours=-1)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    assert_error(client.post(f"/api/runs/{run_a.id}/status/", {"status": "starting"}), 401, "authentication_failed")


def test_a_live_runs_heartbeat_renews_its_token_so_a_run_may_outlast_the_ttl(run_a, settings, assert_error):
    from datetime import timedelta

    from django.utils import timezone
    from rest_framework.test import APIClient

    from fluxrl.accounts.services import create_run_token

    settings.FLUXRL_RUN_TOKEN_TTL_HOURS = 1
    token, key = create_run_token(run_a)
    RunToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() + timedelta(minutes=5))  # almost gone
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    assert client.post(f"/api/runs/{run_a.id}/status/", {"status": "starting"}).status_code == 200
    token.refresh_from_db()
    assert timedelta(minutes=59) < token.expires_at - timezone.now() <= timedelta(hours=1)
    # a token whose run ended is not renewed: it is revoked
    assert client.post(f"/api/runs/{run_a.id}/status/", {"status": "failed", "failure_reason": "x"}).status_code == 200
    token.refresh_from_db()
    assert token.revoked_at is not None
    assert_error(client.post(f"/api/runs/{run_a.id}/status/", {"status": "running"}), 401, "authentication_failed")
