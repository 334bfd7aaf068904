"""What a status report says about the engine (its host and process, the shared engine pools
it is on, the step it resumed after) is taken only from the run's own run token: a team
member's token that names any of it is refused, and nothing of the report is applied; the
status itself a member may still report, and cancel."""
import pytest
from django.test import Client
from rest_framework.test import APIClient

from fluxrl.runs.models import Run, RunStatus
from fluxrl.runs.services import engine_sharing, submit_run, transition
from tests.platform.conftest import make_spec

SHARED = {"model": {"path": "builtin:tiny", "lora": {"rank": 8}}, "rollout": {"share_engines": True}}
POOL = "0123456789ab-0"


@pytest.mark.django_db
def test_a_members_token_cannot_put_a_run_on_another_teams_engine_pool(team_a, team_b, alice, carol, api_a,
                                                                       assert_error):
    theirs = submit_run(team_b, carol, make_spec(name="b-lora", **SHARED))
    transition(theirs, RunStatus.STARTING, worker_host="gpu-node-1")
    transition(theirs, RunStatus.RUNNING, engine_pools=[{"id": POOL, "share": 1.0, "fair_share": 1.0}],
               engine_pools_attested=True)
    mine = submit_run(team_a, alice, make_spec(name="a-run"))
    url = f"/api/runs/{mine.pk}/status/"

    for claim in ({"engine_pools": [{"id": POOL, "share": 0.5, "fair_share": 0.5}], "worker_host": "gpu-node-1"},
                  {"engine_pools": [{"id": POOL, "share": 0.5, "fair_share": 0.5}]},
                  {"worker_host": "gpu-node-1"}, {"worker_pid": 1}, {"resumed_from_step": -1}):
        error = assert_error(api_a.post(url, {"status": "starting", **claim}, format="json"), 403, "permission_denied")
        assert "run's own run token" in error["message"] and set(claim) <= set(error["fields"])
    session = Client()
    session.force_login(alice)
    refused = session.post(url, {"status": "starting", "worker_host": "gpu-node-1"}, content_type="application/json")
    assert refused.status_code == 403 and "run's own run token" in refused.json()["error"]["message"]

    row = Run.objects.get(pk=mine.pk)
    assert (row.status, row.worker_host, row.worker_pid, row.engine_pools) == ("queued", "", None, [])
    assert engine_sharing(Run.objects.get(pk=theirs.pk))[0]["other_team_runs"] == 0  # no run that is not there

    # without them a member's report is still taken, and a member still cancels
    assert api_a.post(url, {"status": "starting"}, format="json").status_code == 200
    assert api_a.post(f"/api/runs/{mine.pk}/cancel/").json()["cancel_requested"] is True


@pytest.mark.django_db
def test_the_runs_own_token_reports_its_engine(run_a, worker_client):
    worker = worker_client(run_a)
    url = f"/api/runs/{run_a.pk}/status/"
    assert worker.post(url, {"status": "starting", "worker_host": "gpu-7", "worker_pid": 42},
                       format="json").status_code == 200
    assert worker.post(url, {"status": "running", "engine_pools": [{"id": POOL, "share": 0.5, "fair_share": 0.5}]},
                       format="json").status_code == 200
    row = Run.objects.get(pk=run_a.pk)
    assert (row.worker_host, row.worker_pid, row.engine_pools[0]["id"]) == ("gpu-7", 42, POOL)


@pytest.mark.django_db
def test_pools_an_engine_of_a_members_own_claims_never_count_on_another_teams_page(team_a, team_b, alice, carol,
                                                                                  api_a, worker_client):
    theirs = submit_run(team_b, carol, make_spec(name="b-lora", **SHARED))
    transition(theirs, RunStatus.STARTING, worker_host="gpu-node-1")
    transition(theirs, RunStatus.RUNNING, engine_pools=[{"id": POOL, "share": 1.0, "fair_share": 1.0}],
               engine_pools_attested=True)
    mine = submit_run(team_a, alice, make_spec(name="a-run", **SHARED))
    # a run token alice mints herself (POST /api/runs/<id>/tokens/), as for an engine she starts by hand
    minted = api_a.post(f"/api/runs/{mine.pk}/tokens/", format="json")
    assert minted.status_code == 201, minted.content
    by_hand = APIClient()
    by_hand.credentials(HTTP_AUTHORIZATION=f"Bearer {minted.json()['key']}")
    url = f"/api/runs/{mine.pk}/status/"
    assert by_hand.post(url, {"status": "starting", "worker_host": "gpu-node-1"}, format="json").status_code == 200
    claim = {"status": "running", "engine_pools": [{"id": POOL, "share": 0.5, "fair_share": 0.5}]}
    assert by_hand.post(url, claim, format="json").status_code == 200
    row = Run.objects.get(pk=mine.pk)
    assert row.engine_pools[0]["id"] == POOL and not row.engine_pools_attested  # kept, as its own page's
    assert engine_sharing(Run.objects.get(pk=theirs.pk))[0]["other_team_runs"] == 0
    assert engine_sharing(row)[0]["other_team_runs"] == 0

    # the engine the platform started (the dispatcher's token) is believed
    dispatched = submit_run(team_a, alice, make_spec(name="a-dispatched", **SHARED))
    worker = worker_client(dispatched)
    assert worker.post(f"/api/runs/{dispatched.pk}/status/", {"status": "starting", "worker_host": "gpu-node-1"},
                       format="json").status_code == 200
    assert worker.post(f"/api/runs/{dispatched.pk}/status/", claim, format="json").status_code == 200
    assert Run.objects.get(pk=dispatched.pk).engine_pools_attested
    assert engine_sharing(Run.objects.get(pk=theirs.pk))[0]["other_team_runs"] == 1
