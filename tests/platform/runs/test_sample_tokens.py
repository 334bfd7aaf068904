"""A sample's per-token texts (`tokens`, one per entry of `versions`): validated, stored,
returned by the samples API, the run page's data and the websocket; samples without them
still work as before."""
import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator

from fluxrl.accounts import services as accounts
from fluxrl.runs import live
from fluxrl.runs.services import add_samples

CHAT = {"uid": "c1", "step": 3, "prompt": "<|user|>12+7=\n<|assistant|>", "completion": "19\n done",
        "reward": 1.0, "versions": [3, 3, 3, 4, 4, 4], "tokens": ["1", "9", "\n", " done", "<|im_end|>", ""]}


def post(client, run, *samples):
    return client.post(f"/api/runs/{run.id}/samples/", {"samples": list(samples)})


def test_tokens_are_stored_and_returned_and_old_samples_have_none(run_a, worker_client, api_a):
    worker = worker_client(run_a)
    old = {"uid": "o1", "step": 2, "prompt": "1+1=", "completion": "2", "versions": [3]}
    assert post(worker, run_a, old, CHAT).status_code == 201
    stored = {s["uid"]: s for s in api_a.get(f"/api/runs/{run_a.id}/samples/").json()["results"]}
    assert stored["c1"]["tokens"] == CHAT["tokens"]  # whitespace and empty texts kept as they are
    assert stored["c1"]["version_runs"] == [[3, 3], [4, 3]] and stored["c1"]["length"] == 6
    assert stored["o1"]["tokens"] is None
    page = api_a.get(f"/api/runs/{run_a.id}/samples/", {"since_step": 2}).json()["results"]
    assert [s["tokens"] for s in page] == [CHAT["tokens"]]


def test_the_run_page_data_carries_the_tokens(run_a, worker_client, alice, client):
    assert post(worker_client(run_a), run_a, CHAT).status_code == 201
    client.force_login(alice)
    page = client.get(f"/runs/{run_a.id}/")
    assert page.status_code == 200
    assert page.context["page_data"]["samples"][0]["tokens"] == CHAT["tokens"]


@pytest.mark.parametrize("tokens, why", [
    (["1", "9"], "one entry per token of versions: 2 tokens for 6 versions"),
    (["1", "9", "\n", " done", "<|im_end|>", "x", "y"], "7 tokens for 6 versions"),
    (["1", 9, "\n", " done", "<|im_end|>", ""], "must be a string"),
    (["1", None, "\n", " done", "<|im_end|>", ""], "null"),
    ("19\n done", "list"),
    (["x" * 201, "9", "\n", " done", "<|im_end|>", ""], "200"),
])
def test_bad_tokens_are_refused_naming_the_field(run_a, worker_client, assert_error, tokens, why):
    error = assert_error(post(worker_client(run_a), run_a, {**CHAT, "tokens": tokens}), 400)
    field = next(f for f in error["fields"] if f.startswith("samples.0.tokens"))
    assert why.lower() in error["fields"][field].lower(), error
    assert not run_a.samples.exists()


def test_tokens_without_versions_and_too_many_tokens_are_refused(run_a, worker_client, assert_error, settings):
    worker = worker_client(run_a)
    assert_error(post(worker, run_a, {**CHAT, "versions": []}), 400, field="samples.0.tokens")
    settings.FLUXRL_SAMPLE_MAX_TOKENS = 4
    error = assert_error(post(worker, run_a, CHAT), 400, field="samples.0.tokens")
    assert "at most 4 tokens" in error["fields"]["samples.0.tokens"]
    assert post(worker, run_a, {**CHAT, "tokens": None}).status_code == 201  # null: as if not given


def test_live_messages_carry_tokens_and_stay_under_the_frame_limit(run_a, monkeypatch):
    long = {**CHAT, "completion": "x" * 3000, "tokens": ["x" * 100] * 6}
    assert add_samples(run_a, [{**long, "uid": f"u{i}"} for i in range(5)]) == 5
    samples = [live.sample_dict(s) for s in run_a.samples.order_by("id")]
    assert samples[0]["tokens"] == long["tokens"]
    monkeypatch.setattr(live, "SAMPLE_BYTES_PER_MESSAGE", 8000)
    messages = live.sample_messages(samples, history=True)
    assert [len(m["samples"]) for m in messages] == [2, 2, 1]  # ~3.8 kB a sample
    assert [s["uid"] for m in messages for s in m["samples"]] == [f"u{i}" for i in range(5)]
    assert all(m["type"] == "samples" and m["history"] for m in messages)
    monkeypatch.setattr(live, "SAMPLE_BYTES_PER_MESSAGE", 100)
    assert [len(m["samples"]) for m in live.sample_messages(samples)] == [1] * 5  # one alone when too large
    assert live.sample_messages([]) == [{"type": "samples", "samples": []}]


@pytest.mark.django_db(transaction=True)  # channels closes connections around each query
def test_the_websocket_sends_tokens_on_connect_and_live(run_a, alice):
    async def check():
        add = database_sync_to_async(add_samples)
        await add(run_a, [{**CHAT, "uid": "first"}])
        key = (await database_sync_to_async(accounts.create_api_token)(alice, "ws"))[1]
        from fluxrl.asgi import application

        ws = WebsocketCommunicator(application, f"/ws/runs/{run_a.id}/",
                                   headers=[(b"origin", b"http://127.0.0.1"), (b"authorization", f"Bearer {key}".encode())])
        assert (await ws.connect())[0]
        messages = [await ws.receive_json_from(timeout=5) for _ in range(3)]
        assert messages[2]["samples"][0]["tokens"] == CHAT["tokens"]
        await add(run_a, [{**CHAT, "uid": "second", "tokens": ["a", "b", "c", "d", "e", "f"]}])
        pushed = await ws.receive_json_from(timeout=5)
        assert pushed["type"] == "samples" and pushed["samples"][0]["tokens"] == list("abcdef")
        await ws.disconnect()

    async_to_sync(check)()
