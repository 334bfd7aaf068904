"""An open ws/runs/<id>/ socket is checked again every FLUXRL_WS_RECHECK_S: a member
removed from the run's team (4404, as for a run that does not exist), a revoked token or
a deactivated user (4401) is closed; a member who stays keeps the socket. Another team's
run and a missing run are refused alike. The real ASGI stack (fluxrl.asgi) with channels'
WebsocketCommunicator, as in tests/platform/metrics/test_live.py."""
import functools

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator

from fluxrl.accounts import services as accounts
from fluxrl.accounts.models import ApiToken, Membership
from fluxrl.asgi import application

pytestmark = pytest.mark.django_db(transaction=True)


def sync(test):
    @functools.wraps(test)
    def run(*args, **kwargs):
        return async_to_sync(test)(*args, **kwargs)

    return run


@pytest.fixture(autouse=True)
def quick_rechecks(settings):
    settings.FLUXRL_WS_RECHECK_S = 0.2
    settings.FLUXRL_WS_STATUS_POLL_S = 0  # only the re-check talks to the database


async def follow(run, user) -> WebsocketCommunicator:
    key = (await database_sync_to_async(accounts.create_api_token)(user, "ws"))[1]
    ws = WebsocketCommunicator(application, f"/ws/runs/{run.id}/",
                               headers=[(b"origin", b"http://127.0.0.1"), (b"authorization", f"Bearer {key}".encode())])
    connected, _ = await ws.connect()
    assert connected
    for _ in range(3):  # status, metrics, samples
        await ws.receive_json_from(timeout=5)
    return ws


async def closed_with(ws) -> int:
    closed = await ws.receive_output(timeout=5)
    assert closed["type"] == "websocket.close", closed
    await ws.disconnect()
    return closed["code"]


@sync
async def test_a_member_removed_from_the_team_is_closed_with_4404(run_a, bob):
    ws = await follow(run_a, bob)
    await database_sync_to_async(Membership.objects.filter(user=bob, team=run_a.team).delete)()
    assert await closed_with(ws) == 4404


async def refusal(path: str, key: str) -> dict:
    ws = WebsocketCommunicator(application, path,
                               headers=[(b"origin", b"http://127.0.0.1"), (b"authorization", f"Bearer {key}".encode())])
    await ws.connect()
    closed = await ws.receive_output(timeout=5)
    await ws.disconnect()
    return closed


@sync
async def test_another_teams_run_and_a_missing_run_are_closed_alike(run_a, carol):
    """No run-id oracle: the close (code and reason, the run id aside) is the same."""
    key = (await database_sync_to_async(accounts.create_api_token)(carol, "ws"))[1]
    missing = run_a.id + 1000
    existing = await refusal(f"/ws/runs/{run_a.id}/", key)
    absent = await refusal(f"/ws/runs/{missing}/", key)
    assert existing["type"] == absent["type"] == "websocket.close"
    assert existing["code"] == absent["code"] == 4404
    assert existing.get("reason", "").replace(str(run_a.id), "<id>") == absent.get("reason", "").replace(str(missing), "<id>")


@sync
async def test_a_revoked_token_or_a_deactivated_user_is_closed_with_4401(run_a, alice, bob):
    ws = await follow(run_a, bob)
    await database_sync_to_async(lambda: [accounts.revoke_api_token(t) for t in ApiToken.objects.filter(user=bob)])()
    assert await closed_with(ws) == 4401
    ws = await follow(run_a, alice)
    await database_sync_to_async(type(alice).objects.filter(pk=alice.pk).update)(is_active=False)
    assert await closed_with(ws) == 4401


@sync
async def test_a_member_who_stays_keeps_the_socket(run_a, bob):
    ws = await follow(run_a, bob)
    assert await ws.receive_nothing(timeout=1.0)  # five re-checks passed
    await ws.disconnect()
