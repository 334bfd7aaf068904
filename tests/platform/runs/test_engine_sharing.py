"""rollout.share_engines on the platform: a run's heartbeat says which shared engine pools it
is on; its page shows who shares them, the own team's runs by name and another team's only
as a count; the engine learns its team's weight from the team record, never from the spec."""
import pytest
from django.test import Client

from fluxrl.runs.dispatch import pool_env
from fluxrl.runs.models import Run, RunStatus
from fluxrl.runs.services import engine_sharing, submit_run, transition
from tests.platform.conftest import make_spec

POOL = "0123456789ab-0"
SHARED = {"model": {"path": "builtin:tiny", "lora": {"rank": 8}}, "rollout": {"share_engines": True}}


def _running(team, user, name):
    run = submit_run(team, user, make_spec(name=name, **SHARED))
    transition(run, RunStatus.STARTING, worker_host="gpu-node-1")
    return transition(run, RunStatus.RUNNING)


def _on_pool(run, share=0.5, fair=0.5, pool=POOL):
    """As the engine the dispatcher started reports it (attested)."""
    transition(run, RunStatus.RUNNING, engine_pools=[{"id": pool, "share": share, "fair_share": fair}],
               engine_pools_attested=True)
    return Run.objects.get(pk=run.pk)


@pytest.mark.django_db
def test_the_heartbeat_reports_the_pools_and_a_bad_report_is_refused(team_a, alice, worker_client, assert_error):
    run = _running(team_a, alice, "shared")
    client = worker_client(run)
    ok = client.post(f"/api/runs/{run.pk}/status/", {"status": "running", "engine_pools": [
        {"id": POOL, "share": 0.61, "fair_share": 0.5}]}, format="json")
    assert ok.status_code == 200, ok.content
    assert Run.objects.get(pk=run.pk).engine_pools == [{"id": POOL, "share": 0.61, "fair_share": 0.5}]
    bad = client.post(f"/api/runs/{run.pk}/status/", {"status": "running", "engine_pools": [
        {"id": "../../etc", "share": 2, "fair_share": 0.5}]}, format="json")
    assert_error(bad, 400, field="engine_pools.0.id")
    assert Run.objects.get(pk=run.pk).engine_pools[0]["share"] == 0.61  # nothing of the bad report was kept


@pytest.mark.django_db
def test_a_team_sees_its_own_runs_on_the_pool_by_name_and_another_teams_only_as_a_count(
        team_a, team_b, alice, carol):
    mine = _on_pool(_running(team_a, alice, "mine-lora"))
    sibling = _on_pool(_running(team_a, alice, "sibling-lora"))
    theirs = _on_pool(_running(team_b, carol, "secret-b-lora"))
    elsewhere = _on_pool(_running(team_b, carol, "other-pool"), pool="ba9876543210-0")

    sharing = engine_sharing(mine)
    assert sharing == [{"id": POOL, "share": 0.5, "fair_share": 0.5,
                        "team_runs": [{"id": sibling.pk, "name": "sibling-lora"}], "other_team_runs": 1}]
    page = Client()
    page.force_login(alice)
    html = page.get(f"/runs/{mine.pk}/").content.decode()
    assert 'id="engine-sharing"' in html and "sibling-lora" in html and 'data-other-teams="1"' in html
    assert "secret-b-lora" not in html and f"/runs/{theirs.pk}/" not in html and f"#{theirs.pk}<" not in html
    assert engine_sharing(theirs)[0]["team_runs"] == [] and engine_sharing(theirs)[0]["other_team_runs"] == 2
    assert engine_sharing(elsewhere)[0]["other_team_runs"] == 0
    transition(sibling, RunStatus.CANCELLED)  # a run that ended shares nothing any more
    assert engine_sharing(mine)[0]["team_runs"] == []


@pytest.mark.django_db
def test_a_run_on_another_worker_host_is_another_pool(team_a, alice):
    mine = _on_pool(_running(team_a, alice, "mine"))
    other = _running(team_a, alice, "same-id-other-node")
    Run.objects.filter(pk=other.pk).update(worker_host="gpu-node-2")
    _on_pool(Run.objects.get(pk=other.pk))
    assert engine_sharing(mine)[0]["team_runs"] == []


@pytest.mark.django_db
def test_the_engine_gets_its_teams_weight_from_the_team_record_in_a_signed_ticket(team_a, alice, data_dir):
    """The weight travels in a ticket the pool checks with the platform's public key; the
    private key stays in the platform's data folder, out of the run's environment."""
    import os
    import stat

    from workers.rollout.tickets import TicketError, read_ticket

    team_a.engine_share = 3.0
    team_a.save()
    run = submit_run(team_a, alice, make_spec(name="weighted", **SHARED))
    env = pool_env(Run.objects.get(pk=run.pk))
    assert set(env) == {"FLUXRL_POOL_TICKET", "FLUXRL_POOL_VERIFIER", "FLUXRL_POOL_RUN"}
    assert env["FLUXRL_POOL_RUN"] == f"#{run.pk} weighted"
    verifier = open(env["FLUXRL_POOL_VERIFIER"]).read()
    ticket = read_ticket(env["FLUXRL_POOL_TICKET"], verifier)
    assert (ticket.tenant, ticket.weight, ticket.run) == (f"team-{team_a.pk}", 3.0, run.pk)
    key = data_dir / "pool-tickets.ed25519"
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600 and "PRIVATE" not in "".join(env.values())
    assert pool_env(Run.objects.get(pk=run.pk))["FLUXRL_POOL_VERIFIER"] == env["FLUXRL_POOL_VERIFIER"]  # one key
    payload, signature = env["FLUXRL_POOL_TICKET"].split(".")
    forged = payload.replace(payload[-6:], "AAAAAA") + "." + signature
    with pytest.raises(TicketError):
        read_ticket(forged, verifier)
