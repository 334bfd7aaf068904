"""The live view of a run: ws/runs/<id>/ through the real ASGI stack (origin check,
session and token auth, routing) with channels' WebsocketCommunicator.

Test bodies are coroutines run by async_to_sync. The database is transactional (each
statement commits) because channels closes "old" connections around every database
call, which would break a test wrapped in one transaction."""
import functools

import pytest

from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.test import Client

from fluxrl.accounts import services as accounts
from fluxrl.asgi import application
from fluxrl.metrics.services import ingest_points
from fluxrl.runs import live
from fluxrl.runs.models import Run, RunStatus
from fluxrl.runs.services import add_samples, transition

pytestmark = pytest.mark.django_db(transaction=True)


def sync(test):
    @functools.wraps(test)
    def run(*args, **kwargs):
        return async_to_sync(test)(*args, **kwargs)

    return run


def points(steps, keys=("reward/mean", "loss/policy")):
    return [{"key": k, "step": s, "value": s / 10, "time": 1763769600.0 + s} for s in steps for k in keys]


def socket(path: str, key: str | None = None, cookie: str | None = None, query_token: bool = False):
    headers = [(b"origin", b"http://127.0.0.1")]
    if key and query_token:
        path += ("&" if "?" in path else "?") + f"token={key}"
    elif key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    if cookie:
        headers.append((b"cookie", cookie.encode()))
    return WebsocketCommunicator(application, path, headers=headers)


async def subscribe(path: str, **auth) -> tuple[WebsocketCommunicator, list[dict]]:
    """Connect and read the three messages sent on connect: status, metrics, samples."""
    ws = socket(path, **auth)
    connected, _ = await ws.connect()
    assert connected
    return ws, [await ws.receive_json_from(timeout=5) for _ in range(3)]


async def refused_with(path: str, **auth) -> int:
    ws = socket(path, **auth)
    await ws.connect()
    closed = await ws.receive_output(timeout=5)
    assert closed["type"] == "websocket.close", closed
    await ws.disconnect()
    return closed["code"]


def key_of(user, **options) -> str:
    return accounts.create_api_token(user, "ws", **options)[1]


@sync
async def test_subscribing_needs_a_signed_in_member_of_the_run_team(run_a, alice, carol, team_a):
    path = f"/ws/runs/{run_a.id}/"
    alice_key, carol_key = await database_sync_to_async(key_of)(alice), await database_sync_to_async(key_of)(carol)
    worker_key = (await database_sync_to_async(accounts.create_run_token)(run_a))[1]
    write_only = await database_sync_to_async(key_of)(alice, scopes=["write"])
    assert await refused_with(path) == 4401
    assert await refused_with(path, key="flxu_not-a-key") == 4401
    assert await refused_with(path, key=carol_key) == 4404  # another team's run: as if missing
    assert await refused_with(path, key=worker_key) == 4403  # run tokens report, they do not watch
    assert await refused_with(path, key=write_only) == 4403
    assert await refused_with("/ws/runs/999999/", key=alice_key) == 4404
    assert await refused_with(f"{path}?since_step=x", key=alice_key) == 4400
    ws, (status, _, _) = await subscribe(path, key=alice_key, query_token=True)  # browsers: ?token=
    assert status["status"] == "queued"
    await ws.disconnect()


@sync
async def test_a_signed_in_browser_subscribes_with_its_session(run_a, alice):
    browser = Client()
    await database_sync_to_async(browser.force_login)(alice)
    cookie = f"sessionid={browser.cookies['sessionid'].value}"
    ws, (status, metrics, samples) = await subscribe(f"/ws/runs/{run_a.id}/", cookie=cookie)
    assert (status["type"], status["run"], metrics["type"], samples["type"]) == ("status", run_a.id, "metrics", "samples")
    await ws.disconnect()


@sync
async def test_history_then_live_appends_then_status_and_samples(run_a, alice):
    await database_sync_to_async(ingest_points)(run_a, points(range(3)))
    ws, (status, history, samples) = await subscribe(f"/ws/runs/{run_a.id}/", key=await database_sync_to_async(key_of)(alice))
    assert [(p["step"], p["key"]) for p in history["points"]] == [(s, k) for s in range(3) for k in ("loss/policy", "reward/mean")]
    assert history["history"] is True and samples["samples"] == []

    await database_sync_to_async(ingest_points)(run_a, points([3, 4]))
    live_batch = await ws.receive_json_from(timeout=5)
    assert live_batch["type"] == "metrics" and sorted({p["step"] for p in live_batch["points"]}) == [3, 4]

    def start_and_sample():
        transition(run_a, RunStatus.STARTING, worker_host="gpu-1")  # pushed once committed
        add_samples(run_a, [{"step": 4, "prompt": "1+1=", "completion": "2", "reward": 1.0, "versions": [3, 4]}])

    await database_sync_to_async(start_and_sample)()
    status = await ws.receive_json_from(timeout=5)
    assert (status["type"], status["status"], status["worker_host"]) == ("status", "starting", "gpu-1")
    sample = (await ws.receive_json_from(timeout=5))["samples"][0]
    assert (sample["completion"], sample["reward"], sample["version_runs"]) == ("2", 1.0, [[3, 1], [4, 1]])
    await ws.disconnect()


@sync
async def test_reconnecting_with_since_step_sends_only_the_missed_points(run_a, alice):
    key = await database_sync_to_async(key_of)(alice)
    await database_sync_to_async(ingest_points)(run_a, points(range(3)))
    ws, (_, history, _) = await subscribe(f"/ws/runs/{run_a.id}/", key=key)
    last_step = max(p["step"] for p in history["points"])
    await ws.disconnect()

    await database_sync_to_async(ingest_points)(run_a, points([3, 4]))  # while disconnected
    ws, (_, missed, _) = await subscribe(f"/ws/runs/{run_a.id}/?since_step={last_step}", key=key)
    assert sorted({p["step"] for p in missed["points"]}) == [3, 4] and len(missed["points"]) == 4
    await ws.disconnect()


@sync
async def test_history_is_downsampled_to_max_points_per_series(run_a, alice):
    await database_sync_to_async(ingest_points)(run_a, points(range(500), keys=["reward/mean"]))
    key = await database_sync_to_async(key_of)(alice)
    ws, (_, history, _) = await subscribe(f"/ws/runs/{run_a.id}/?max_points=50", key=key)
    steps = [p["step"] for p in history["points"]]
    assert len(steps) <= 50 and steps[0] == 0 and steps[-1] == 499
    await ws.disconnect()


@sync
async def test_status_changed_elsewhere_still_arrives(run_a, alice, settings):
    # A change whose push never reaches this server (as when the Celery worker pushes to
    # its own in-memory layer; here a bare update) is picked up by the consumer's poll.
    settings.FLUXRL_WS_STATUS_POLL_S = 0.1
    ws, (status, _, _) = await subscribe(f"/ws/runs/{run_a.id}/", key=await database_sync_to_async(key_of)(alice))
    assert status["status"] == "queued"
    changed = Run.objects.filter(pk=run_a.pk).update
    await database_sync_to_async(changed)(status=RunStatus.FAILED, failure_reason="lost")
    status = await ws.receive_json_from(timeout=5)
    assert (status["status"], status["failure_reason"]) == ("failed", "lost")
    await ws.disconnect()


@sync
async def test_each_stored_batch_is_pushed_to_the_run_group(run_a, worker_client):
    layer = get_channel_layer()
    channel = await layer.new_channel()
    await layer.group_add(live.group_name(run_a.id), channel)
    batch = points([7])
    worker = await database_sync_to_async(worker_client)(run_a)
    response = await database_sync_to_async(worker.post)(f"/api/runs/{run_a.id}/metrics/", {"points": batch})
    assert response.status_code == 201
    event = await layer.receive(channel)
    assert event["type"] == "run.event" and live.client_message(event["message"]) == {"type": "metrics", "points": batch}
    await layer.group_discard(live.group_name(run_a.id), channel)
