"""The client's parts that need no server: what `fluxrl watch` shows from a run's live
messages, the websocket address, where the login comes from."""
import pytest

from workers.io.client import FluxClient
from workers.cli.fluxrl import RunProgress, load_login, save_login


def metrics(*points, history=False):
    return {"type": "metrics", "points": [{"key": k, "step": s, "value": v, "time": 0.0} for k, s, v in points],
            "history": history}


def test_progress_follows_steps_latest_values_and_the_end_of_the_run():
    progress = RunProgress(total_steps=10)
    progress.update({"type": "status", "status": "running", "failure_reason": ""})
    progress.update(metrics(("reward/mean", 1, 0.1), ("throughput/samples_per_s", 1, 50.0), history=True))
    progress.update(metrics(("reward/mean", 3, 0.5), ("eval/accuracy", 2, 0.25)))
    progress.update(metrics(("reward/mean", 1, 0.1)))  # a retried batch pushed again
    assert (progress.step, progress.done) == (3, False)
    assert progress.postfix() == {"reward": "0.5", "samples/s": "50", "acc": "0.25"}
    progress.update({"type": "samples", "samples": []})
    progress.update({"type": "status", "status": "failed", "failure_reason": "The engine exited with code 1."})
    assert progress.done and progress.failure_reason == "The engine exited with code 1."


@pytest.mark.parametrize("url, since, expected", [
    ("http://127.0.0.1:8000", None, "ws://127.0.0.1:8000/ws/runs/7/"),
    ("https://fluxrl.example/", 12, "wss://fluxrl.example/ws/runs/7/?since_step=12"),
    ("https://example.org/fluxrl", 0, "wss://example.org/fluxrl/ws/runs/7/?since_step=0"),
])
def test_websocket_address_follows_the_server_url(url, since, expected):
    assert FluxClient(url, "flxu_x").ws_url(7, since) == expected


def test_environment_wins_over_the_stored_login(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("FLUXRL_URL", raising=False)
    monkeypatch.delenv("FLUXRL_TOKEN", raising=False)
    with pytest.raises(SystemExit, match="not logged in"):
        load_login()
    save_login("http://stored:8000", "flxu_stored")
    monkeypatch.setenv("FLUXRL_TOKEN", "flxu_env")
    assert load_login() == ("http://stored:8000", "flxu_env")
