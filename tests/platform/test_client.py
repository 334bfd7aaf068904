"""The Python client and the `fluxrl` CLI (workers/io/client.py, workers/cli/fluxrl.py)
against a live server of the platform over HTTP. Their websocket side is exercised
against daphne in runs/test_dispatch_engine.py."""
import json
import stat

import pytest

from fluxrl.runs.models import Run
from fluxrl.runs.services import add_samples
from workers.io.client import ApiError, FluxClient
from workers.cli.fluxrl import main

pytestmark = pytest.mark.django_db(transaction=True)  # the live server runs in another thread


@pytest.fixture
def key(alice):
    from fluxrl.accounts.services import create_api_token

    return create_api_token(alice, "cli")[1]


@pytest.fixture
def cli(live_server, key, tmp_path, monkeypatch, capsys):
    """Runs `fluxrl ...` logged in to the live server; returns (exit code, stdout, stderr)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    for name in ("FLUXRL_URL", "FLUXRL_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    assert main(["login", "--url", live_server.url, "--token", key]) == 0
    capsys.readouterr()

    def run(*argv):
        code = main([str(a) for a in argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_login_checks_the_token_and_keeps_it_private(live_server, key, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert main(["login", "--url", live_server.url, "--token", "flxu_wrong"]) == 2
    assert "Invalid, expired or revoked token" in capsys.readouterr().err
    assert not (tmp_path / "fluxrl" / "config.json").exists()

    assert main(["login", "--url", live_server.url + "/", "--token", key]) == 0
    assert "as alice (teams: team-a)" in capsys.readouterr().out
    config = tmp_path / "fluxrl" / "config.json"
    assert json.loads(config.read_text()) == {"url": live_server.url, "token": key}
    assert stat.S_IMODE(config.stat().st_mode) == 0o600


def test_submit_list_cancel_and_download_samples(cli, live_server, tmp_path):
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text("name: from-cli\nmodel: {path: builtin:tiny}\ntask: {dataset: 'gen:add?max_digits=2'}\n")
    code, out, _ = cli("submit", spec_file, "--tag", "cli", "--tag", "demo")
    run = Run.objects.get(name="from-cli")
    assert code == 0 and out.splitlines() == [
        f"run {run.pk} queued: from-cli",
        f"  dashboard: {live_server.url}/runs/{run.pk}/",
        f"  API:       {live_server.url}/api/runs/{run.pk}/",
    ]

    code, out, _ = cli("runs", "--tag", "cli")
    assert code == 0 and f"{run.pk}  queued" in out and "cli,demo" in out

    add_samples(run, [{"step": s, "prompt": f"{s}+1=", "completion": str(s + 1), "reward": 1.0, "versions": [s]}
                      for s in range(3)])
    code, _, err = cli("samples", run.pk, "-o", tmp_path / "samples.jsonl", "--since-step", 0)
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert code == 0 and [s["step"] for s in lines] == [1, 2] and lines[0]["version_runs"] == [[1, 1]]
    assert "2 samples written" in err

    code, out, _ = cli("cancel", run.pk)
    assert (code, out.strip()) == (0, f"run {run.pk}: cancel requested (cancelled)")
    code, _, err = cli("cancel", run.pk)
    assert code == 2 and "already cancelled. (409 illegal_transition)" in err


def test_api_errors_name_the_bad_fields(cli, tmp_path):
    spec_file = tmp_path / "bad.yaml"
    spec_file.write_text("name: bad\nmodel: {path: x}\ntask: {dataset: 'gen:add'}\ncolour: red\n")
    code, _, err = cli("submit", spec_file)
    assert code == 2 and "(400 invalid)" in err and "\n  spec.colour: " in err
    assert cli("watch", 999999)[:1] == (2,)


def test_the_client_pages_through_lists(live_server, key, team_a, alice, spec):
    from fluxrl.runs.services import submit_run

    for n in range(5):
        submit_run(team_a, alice, spec(name=f"run-{n}"))
    client = FluxClient(live_server.url, key)
    assert [r["name"] for r in client.pages("runs/", {"limit": 2})] == [f"run-{n}" for n in reversed(range(5))]
    with pytest.raises(ApiError) as error:
        FluxClient(live_server.url, "flxu_nope").runs()
    assert (error.value.status, error.value.code) == (401, "authentication_failed")
