"""A run token a member mints (POST /api/runs/<id>/tokens/) ends with the minter's rights:
refused (401, saying why) once they leave the run's team or are deactivated, never valid
past the API token that minted it, and ended when that API token is revoked; a heartbeat
renews it only within those bounds. The dispatcher's own tokens (no minter) serve the
run's engine while the run is live. Over HTTP against the live server."""
from datetime import timedelta

import pytest
import requests
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from fluxrl.accounts import services as accounts
from fluxrl.accounts.models import ApiToken, Membership, RunToken

pytestmark = pytest.mark.django_db(transaction=True)


class Api:
    def __init__(self, base: str, key: str):
        self.base, self.headers = base, {"Authorization": f"Bearer {key}"}

    def __getattr__(self, method):
        return lambda path, **kw: requests.request(method.upper(), self.base + path, headers=self.headers,
                                                   timeout=30, **kw)


@pytest.fixture
def minted(live_server, run_a, bob):
    """(bob's API token, his client, a run token he minted for run_a, its client)."""
    def mint(**token_options):
        api_token, key = accounts.create_api_token(bob, "minter", **token_options)
        bob_api = Api(live_server.url, key)
        created = bob_api.post(f"/api/runs/{run_a.id}/tokens/")
        assert created.status_code == 201, created.text
        return api_token, bob_api, created.json(), Api(live_server.url, created.json()["key"])
    return mint


def refusal(response) -> str:
    assert response.status_code == 401, (response.status_code, response.text[:300])
    return response.json()["error"]["message"]


def test_removing_the_minter_from_the_team_makes_their_run_token_401_at_once(live_server, run_a, alice, minted):
    _, _, _, worker = minted()
    dispatcher = Api(live_server.url, accounts.create_run_token(run_a)[1])  # the system's, for the engine
    assert worker.get(f"/api/runs/{run_a.id}/samples/").status_code == 200
    assert worker.post(f"/api/runs/{run_a.id}/status/", json={"status": "starting"}).status_code == 200
    admin = Api(live_server.url, accounts.create_api_token(alice, "admin")[1])
    assert admin.delete(f"/api/teams/{run_a.team.slug}/members/bob/").status_code == 204
    assert "no longer an active member" in refusal(worker.get(f"/api/runs/{run_a.id}/samples/"))
    refusal(worker.post(f"/api/runs/{run_a.id}/status/", json={"status": "starting"}))  # no renewal either
    assert dispatcher.get(f"/api/runs/{run_a.id}/samples/").status_code == 200  # the run's own engine goes on


def test_a_run_token_is_refused_when_the_membership_goes_by_any_path(run_a, bob, minted):
    _, _, _, worker = minted()
    Membership.objects.filter(user=bob, team=run_a.team).delete()  # not through remove_member: no revocation
    assert "no longer an active member" in refusal(worker.get(f"/api/runs/{run_a.id}/samples/"))
    Membership.objects.create(user=bob, team=run_a.team)
    type(bob).objects.filter(pk=bob.pk).update(is_active=False)
    refusal(worker.get(f"/api/runs/{run_a.id}/samples/"))


def test_a_run_token_minted_by_an_expiring_api_token_expires_with_it(run_a, settings, minted):
    settings.FLUXRL_RUN_TOKEN_TTL_HOURS = 0  # run tokens of their own would never expire
    api_expiry = timezone.now() + timedelta(hours=1)
    api_token, _, created, worker = minted(expires_at=api_expiry)
    assert created["expires_at"] and parse_datetime(created["expires_at"]) <= api_expiry
    settings.FLUXRL_RUN_TOKEN_TTL_HOURS = 24  # a heartbeat would renew it for a day
    assert worker.post(f"/api/runs/{run_a.id}/status/", json={"status": "starting"}).status_code == 200
    token = RunToken.objects.get(prefix=created["prefix"])
    assert token.expires_at <= api_expiry  # renewed, but not past the API token
    ApiToken.objects.filter(pk=api_token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert "expired" in refusal(worker.get(f"/api/runs/{run_a.id}/samples/"))


def test_revoking_the_api_token_ends_the_run_tokens_it_minted(run_a, minted):
    api_token, bob_api, created, worker = minted()
    assert worker.get(f"/api/runs/{run_a.id}/samples/").status_code == 200
    assert bob_api.delete(f"/api/tokens/{api_token.pk}/").status_code == 204
    refusal(worker.get(f"/api/runs/{run_a.id}/samples/"))
    assert RunToken.objects.get(prefix=created["prefix"]).revoked_at is not None
