"""Quotas that a new team does not reset: a person's live runs and uploads count in all
their teams together, an organisation's teams share its limits, and a run's weight on a
shared engine pool is its organisation's (or its team's), however many teams there are."""
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from fluxrl.accounts.models import Organisation
from fluxrl.quotas.models import OrganisationQuota, UserQuota
from fluxrl.quotas.services import pool_tenant
from fluxrl.runs.models import Run
from fluxrl.runs.services import submit_run

ROWS = b'{"prompt": "1+1=", "answer": "2"}\n'


def post_run(client, spec, team=None):
    return client.post("/api/runs/", {"spec": spec(), **({"team": team} if team else {})}, format="json")


def upload(client, team, name):
    return client.post("/api/datasets/", {"file": SimpleUploadedFile(f"{name}.jsonl", ROWS), "name": name,
                                          "team": team}, format="multipart")


def test_a_team_of_ones_own_brings_no_more_live_runs(api_a, alice, spec, settings, assert_error):
    settings.FLUXRL_QUOTA_RUNS = settings.FLUXRL_QUOTA_USER_RUNS = 3
    settings.FLUXRL_TEAM_CREATION = "anyone"  # even where anyone may create teams
    assert [post_run(api_a, spec).status_code for _ in range(3)] == [201, 201, 201]
    assert_error(post_run(api_a, spec), 403, "quota_exceeded", field="team")
    assert api_a.post("/api/teams/", {"name": "Side", "slug": "side"}).status_code == 201
    error = assert_error(post_run(api_a, spec, team="side"), 403, "quota_exceeded", field="owner")
    message = error["message"]
    assert message.startswith("person quota of user 'alice'") and "3 of 3 concurrent runs in use" in message
    assert "FLUXRL_QUOTA_USER_RUNS" in message and "UserQuota" in message and "platform admin" in message
    assert Run.objects.filter(owner=alice).count() == 3


def test_an_admin_set_person_quota_counts_uploads_in_every_team(api_a, alice, make_member, team_b, assert_error):
    make_member("alice", team_b)
    UserQuota.objects.create(user=alice, max_files=1)
    assert upload(api_a, "team-a", "first").status_code == 201
    error = assert_error(upload(api_a, "team-b", "second"), 413, "quota_exceeded", field="file")
    assert error["message"].startswith("person quota of user 'alice'") and "1 of 1 files stored" in error["message"]
    assert "the person's quota, max_files" in error["message"]
    quota = api_a.get("/api/teams/team-b/quota/").json()
    assert quota["files"]["used"] == 0 and quota["person"]["files"] == {
        "used": 1, "limit": 1, "source": "the person's quota, max_files, set by an admin"}
    assert quota["organisation"] is None


def test_an_organisations_teams_share_its_limits(api_a, api_b, team_a, team_b, spec, settings, assert_error):
    acme = Organisation.objects.create(name="Acme", slug="acme")
    team_a.organisation = team_b.organisation = acme
    team_a.save()
    team_b.save()
    OrganisationQuota.objects.create(organisation=acme, max_runs=2)
    assert post_run(api_a, spec).status_code == 201
    assert post_run(api_b, spec).status_code == 201
    error = assert_error(post_run(api_b, spec), 403, "quota_exceeded", field="organisation")
    assert error["message"].startswith("organisation quota of organisation 'acme'")
    assert "2 of 2 concurrent runs in use" in error["message"] and "OrganisationQuota" in error["message"]
    settings.FLUXRL_QUOTA_ORG_FILES = 1  # the deployment default for organisations without a value of their own
    assert upload(api_a, "team-a", "a").status_code == 201
    error = assert_error(upload(api_b, "team-b", "b"), 413, "quota_exceeded", field="file")
    assert "FLUXRL_QUOTA_ORG_FILES" in error["message"]
    quota = api_b.get("/api/teams/team-b/quota/").json()["organisation"]
    assert quota["slug"] == "acme" and quota["runs"]["used"] == 2 and quota["files"] == {
        "used": 1, "limit": 1, "source": "FLUXRL_QUOTA_ORG_FILES, the deployment default"}


@pytest.mark.django_db
def test_a_runs_pool_tenant_is_its_organisation_else_its_team_with_the_operators_weight(team_a, team_b, alice,
                                                                                         carol, spec):
    team_a.engine_share = 3.0
    team_a.save()
    run_a = submit_run(team_a, alice, spec())
    assert pool_tenant(run_a) == (f"team-{team_a.pk}", 3.0)
    acme = Organisation.objects.create(name="Acme", slug="acme", engine_share=2.0)
    team_a.organisation = team_b.organisation = acme
    team_a.save()
    team_b.save()
    run_b = submit_run(team_b, carol, spec())
    # one tenant for all the organisation's teams, with its weight: more teams add none
    assert pool_tenant(run_a) == pool_tenant(run_b) == (f"org-{acme.pk}", 2.0)
