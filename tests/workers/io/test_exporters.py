"""The metric exporters (report.tensorboard, report.mlflow, report.wandb) fed by the Reporter:
each writes exactly the points metrics.jsonl gets, read back with the tool's own reader; one
that fails is logged once and dropped while the others and the Reporter go on; a run without
exporters imports none of their packages."""
import json
import logging
import os
import subprocess
import sys

import pytest

from tests.http_listener import listener
from tests.workers.exported import mlflow_metrics, tensorboard_scalars, wandb_config, wandb_history, wandb_run
from workers.io.exporters import mlflow_key, open_exporters
from workers.io.report import Reporter
from workers.spec import ReportSpec

ALL_THREE = {"tensorboard": {}, "mlflow": {"experiment": "unit"}, "wandb": {"project": "unit", "tags": ["t1"]}}
CONFIG = {"name": "unit-run", "algorithm": {"lr": 5e-05, "group_size": 4}, "rollout": {"stop": ["\n", "x"]}}
# steps as the engine sends them: step 0's points, then steps, an evaluation at a step
# already reported (the same step again, after a later one) and a key first seen late
STREAM = [
    (0, {"data/skipped_prompts": 0.0, "eval/accuracy": 0.25}),
    (1, {"reward/mean": 0.5, "loss/policy": -0.125, "staleness/hist/0": 16.0}),
    (2, {"reward/mean": 0.75, "loss/policy": 0.0625, "staleness/hist/1": 4.0}),
    (2, {"eval/accuracy": 0.5, "eval/held_out/pass@4": 0.75}),
    (1, {"weights/gen_stall_ms": 3.5}),
    (3, {"reward/mean": 1.0, "loss/policy": 0.03125}),
]


def exporters_for(report: dict, out, resume_step=None):
    """The exporters a spec's report section opens (validated by the spec's own model)."""
    return open_exporters(ReportSpec.model_validate(report).model_dump(), out, "unit-run", CONFIG, resume_step)


def expected_series(stream=STREAM) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for step, values in stream:
        for key, value in values.items():
            series.setdefault(key, []).append((step, value))
    return series


def by_step(series):
    return {key: sorted(points) for key, points in series.items()}


def test_all_three_exporters_write_every_point_the_jsonl_gets_and_their_readers_read_them_back(tmp_path):
    out = tmp_path / "run"
    reporter = Reporter(out / "metrics.jsonl")
    reporter.exporters = exporters_for(ALL_THREE, out)
    for step, values in STREAM:
        reporter.log(step, values)
    status = reporter.exporters.close()
    reporter.close()
    assert status == {"tensorboard": "ok", "mlflow": "ok", "wandb": "ok"}

    jsonl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = expected_series()
    assert by_step(expected_series([(p["step"], {p["key"]: p["value"]}) for p in jsonl])) == by_step(expected)

    # TensorBoard: <run>/tensorboard, one scalar series per key at the engine's steps
    assert by_step(tensorboard_scalars(out / "tensorboard")) == by_step(expected)

    # MLflow: a file store in <run>/mlruns, experiment 'unit', the spec as params
    # (MLflow refuses '@' in a name: pass@4 arrives as pass_at_4)
    run, metrics = mlflow_metrics((out / "mlruns").as_uri(), "unit")
    assert by_step(metrics) == by_step({mlflow_key(key): points for key, points in expected.items()})
    assert "eval/held_out/pass_at_4" in metrics
    assert run.info.status == "FINISHED" and run.info.run_name == "unit-run"
    assert run.data.params["algorithm.lr"] == "5e-05" and run.data.params["rollout.stop"] == '["\\n", "x"]'
    assert json.loads((out / "exporters.json").read_text())["mlflow_run_id"] == run.info.run_id

    # W&B: an offline run under <run>/wandb, each row at the engine's step, in the order sent
    folder, records = wandb_run(out)
    assert wandb_history(records) == expected
    assert wandb_config(records)["algorithm"] == {"lr": 5e-05, "group_size": 4}
    run_record = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run_record.project, run_record.display_name, list(run_record.tags)) == ("unit", "unit-run", ["t1"])
    assert folder.name.endswith(run_record.run_id)


def test_relative_and_absolute_folders_and_an_mlflow_folder_uri(tmp_path):
    out, elsewhere = tmp_path / "run", tmp_path / "shared"
    report = {"tensorboard": {"dir": str(elsewhere / "tb")}, "wandb": {"dir": "logs"},
              "mlflow": {"tracking_uri": (elsewhere / "mlruns").as_uri(), "experiment": "e2", "run_name": "named",
                         "tags": {"team": "blue"}}}
    exporters = exporters_for(report, out)
    exporters.put([{"key": "reward/mean", "step": 4, "value": 0.5, "time": 1.0e9}])
    assert exporters.close() == {"tensorboard": "ok", "mlflow": "ok", "wandb": "ok"}
    assert tensorboard_scalars(elsewhere / "tb") == {"reward/mean": [(4, 0.5)]}
    run, metrics = mlflow_metrics((elsewhere / "mlruns").as_uri(), "e2")
    assert metrics == {"reward/mean": [(4, 0.5)]}
    assert run.info.run_name == "named" and run.data.tags["team"] == "blue"
    assert wandb_history(wandb_run(out / "logs")[1]) == {"reward/mean": [(4, 0.5)]}


def test_a_failing_exporter_is_logged_once_dropped_and_the_others_and_the_reporter_go_on(tmp_path, caplog):
    out = tmp_path / "run"
    (out / "tb-file").parent.mkdir(parents=True)
    (out / "tb-file").write_text("a file where the event folder should be")
    reporter = Reporter(out / "metrics.jsonl")
    report = {"tensorboard": {"dir": "tb-file"}, "mlflow": {"tracking_uri": "nosuchscheme://host/x"},
              "wandb": {"project": "unit"}}
    with caplog.at_level(logging.INFO, logger="workers.io.exporters"):
        reporter.exporters = exporters_for(report, out)
        for step, values in STREAM:
            reporter.log(step, values)
        status = reporter.exporters.close()
    reporter.close()

    assert status["wandb"] == "ok"
    assert status["tensorboard"].startswith("failed (opening): ")
    assert status["mlflow"].startswith("failed (opening): ") and "nosuchscheme" in status["mlflow"]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2  # once each, however many points came after
    assert any(m.startswith("report.tensorboard failed while opening") for m in errors)
    assert any(m.startswith("report.mlflow failed while opening") and "training goes on" in m for m in errors)
    assert wandb_history(wandb_run(out)[1]) == expected_series()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == sum(len(v) for _, v in STREAM)


def test_a_missing_package_drops_its_exporter_with_a_hint(tmp_path, caplog, monkeypatch):
    for name in ["mlflow", *(m for m in list(sys.modules) if m.startswith("mlflow."))]:
        monkeypatch.setitem(sys.modules, name, None)  # what `import mlflow` meets where it is not installed
    with caplog.at_level(logging.ERROR, logger="workers.io.exporters"):
        exporters = exporters_for({"mlflow": {}, "tensorboard": {}}, tmp_path)
        exporters.put([{"key": "reward/mean", "step": 1, "value": 0.5, "time": 1.0e9}])
        status = exporters.close()
    assert status["tensorboard"] == "ok" and "ModuleNotFoundError" in status["mlflow"]
    assert "pip install its package on the worker" in caplog.text
    assert tensorboard_scalars(tmp_path / "tensorboard") == {"reward/mean": [(1, 0.5)]}


def test_a_resumed_run_continues_the_same_mlflow_run_and_purges_tensorboard_after_its_checkpoint(tmp_path):
    report = {"tensorboard": {}, "mlflow": {"experiment": "resume"}}
    first = exporters_for(report, tmp_path)
    first.put([{"key": "reward/mean", "step": s, "value": s / 8, "time": 1.0e9 + s} for s in range(5)])
    assert first.close(failed=True) == {"tensorboard": "ok", "mlflow": "ok"}
    run, _ = mlflow_metrics((tmp_path / "mlruns").as_uri(), "resume")
    assert run.info.status == "FAILED"

    again = exporters_for(report, tmp_path, resume_step=2)  # steps 3 and 4 are computed again
    again.put([{"key": "reward/mean", "step": s, "value": s / 64, "time": 1.0e9 + 10 + s} for s in (3, 4, 5)])
    assert again.close() == {"tensorboard": "ok", "mlflow": "ok"}
    assert tensorboard_scalars(tmp_path / "tensorboard") == {
        "reward/mean": [(0, 0.0), (1, 0.125), (2, 0.25), (3, 3 / 64), (4, 4 / 64), (5, 5 / 64)]}  # exact in float32
    resumed, metrics = mlflow_metrics((tmp_path / "mlruns").as_uri(), "resume")  # still the one run
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    assert [p for p in metrics["reward/mean"] if p[0] >= 3] == [(3, 3 / 8), (4, 4 / 8), (3, 3 / 64), (4, 4 / 64),
                                                               (5, 5 / 64)]  # MLflow keeps both attempts' points


def test_the_reporter_drops_no_point_and_never_waits_on_a_slow_exporter(tmp_path):
    from workers.io.exporters import Exporter, Exporters

    class Slow(Exporter):
        name = "slow"

        def open(self):
            self.got = []

        def write(self, points):
            import time

            time.sleep(0.2)
            self.got.extend(points)

    slow = Slow({}, tmp_path, "r", {}, {}, None)
    reporter = Reporter(tmp_path / "metrics.jsonl")
    reporter.exporters = Exporters([slow], tmp_path).start()
    import time

    t0 = time.perf_counter()
    for step in range(20):
        reporter.log(step, {"reward/mean": step})
    assert time.perf_counter() - t0 < 2.0  # 20 writes of 0.2 s would take 4 s (slack for a loaded CI machine)
    assert reporter.exporters.close() == {"slow": "ok"}
    assert [(p["step"], p["value"]) for p in slow.got] == [(s, float(s)) for s in range(20)]


def test_a_run_without_exporters_imports_none_of_their_packages():
    code = ("import sys, tempfile, pathlib\n"
            "from workers.coord.controller import Controller\n"
            "from workers.io.report import Reporter\n"
            "from workers.spec import validate_spec\n"
            "out = pathlib.Path(tempfile.mkdtemp())\n"
            "spec = validate_spec({'name': 'n', 'model': {'path': 'builtin:tiny'}, 'task': {'dataset': 'gen:add'}})\n"
            "c = Controller(spec, out, progress=False)\n"
            "assert c._open_exporters() is None\n"
            "c.reporter.log(1, {'reward/mean': 0.5})\n"
            "loaded = sorted(m for m in ('mlflow', 'wandb', 'tensorboard', 'torch.utils.tensorboard') if m in sys.modules)\n"
            "assert not loaded, loaded\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("report, field", [
    ({"tensorboard": {"folder": "x"}}, "report.tensorboard.folder"),
    ({"wandb": {"mode": "cloud"}}, "report.wandb.mode"),
    ({"mlflow": {"experiment": ""}}, "report.mlflow.experiment"),
    ({"mlflow": {"tags": {"k": ["not", "text"]}}}, "report.mlflow.tags.k"),
    ({"swanlab": {}}, "report.swanlab"),
])
def test_a_bad_report_section_names_the_field(report, field):
    from workers.spec import SpecError, validate_spec

    with pytest.raises(SpecError) as err:
        validate_spec({"name": "n", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
                       "report": report})
    assert [e["field"] for e in err.value.errors] == [field]


def test_true_switches_an_exporter_on_with_its_defaults_and_false_or_null_off():
    report = ReportSpec.model_validate({"tensorboard": True, "mlflow": False, "wandb": None})
    assert report.enabled() == ["tensorboard"] and report.tensorboard.dir == "tensorboard"
    assert ReportSpec().enabled() == []


def test_the_platform_check_refuses_folders_outside_the_run_and_accepts_servers_and_relative_folders():
    from workers.spec import report_paths_outside_run

    outside = ReportSpec.model_validate({"tensorboard": {"dir": "/var/tb"}, "wandb": {"dir": "a/../../b"},
                                         "mlflow": {"tracking_uri": "file:///srv/mlruns"}})
    assert [e["field"] for e in report_paths_outside_run(outside)] == [
        "report.tensorboard.dir", "report.wandb.dir", "report.mlflow.tracking_uri"]
    for uri in ("../mlruns", "~/mlruns", "sqlite:///x.db"):
        assert report_paths_outside_run(ReportSpec.model_validate({"mlflow": {"tracking_uri": uri}}))
    inside = ReportSpec.model_validate({"tensorboard": {"dir": "tb/x"}, "wandb": {},
                                        "mlflow": {"tracking_uri": "https://mlflow.example:5000"}})
    assert report_paths_outside_run(inside) == []
    # with the deployment's list (the platform's FLUXRL_MLFLOW_SERVERS) only its origins pass
    assert report_paths_outside_run(inside, ["https://mlflow.example:5000"]) == []
    assert report_paths_outside_run(inside, ["https://MLFLOW.example:5000/"]) == []  # case, path: one origin
    assert report_paths_outside_run(ReportSpec.model_validate({"mlflow": {"tracking_uri": "https://mlflow.example"}}),
                                    ["https://mlflow.example:443"]) == []  # the default port filled in
    for uri in ("http://mlflow.example:5000", "https://mlflow.example:5001", "https://169.254.169.254/"):
        errors = report_paths_outside_run(ReportSpec.model_validate({"mlflow": {"tracking_uri": uri}}),
                                          ["https://mlflow.example:5000"])
        assert [e["field"] for e in errors] == ["report.mlflow.tracking_uri"], uri
    assert "none: set FLUXRL_MLFLOW_SERVERS" in report_paths_outside_run(inside, [])[0]["message"]


def test_the_workers_mlflow_credentials_go_only_to_its_own_server(tmp_path, monkeypatch):
    """A spec names any MLflow server; the worker's token must not travel to one it was not made for."""
    from workers.io.exporters import MlflowExporter

    def exporter():  # keep_credentials_home reads nothing of the instance but the class's names
        return MlflowExporter.__new__(MlflowExporter)

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.internal:5000")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "operator-secret")
    exporter().keep_credentials_home("https://MLFLOW.internal:5000")  # its own server: kept
    assert os.environ["MLFLOW_TRACKING_TOKEN"] == "operator-secret"
    exporter().keep_credentials_home("https://elsewhere.example:5000/")  # another server: dropped
    assert "MLFLOW_TRACKING_TOKEN" not in os.environ
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "pw")
    exporter().keep_credentials_home((tmp_path / "mlruns").as_uri())  # a local store needs none either
    assert "MLFLOW_TRACKING_PASSWORD" not in os.environ


SPEC = {"name": "n", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"}}


def test_an_mlflow_uri_the_http_client_reads_as_another_host_is_refused_and_never_reached(tmp_path, monkeypatch):
    """urlsplit reads 'http://127.0.0.1:P\\@mlflow.internal:5000' as host mlflow.internal (an
    allowed server); urllib3, which MLflow's client connects with, stops at the backslash and
    connects to 127.0.0.1:P. What the checks let through is what a worker opens: here nothing."""
    from urllib3.util import parse_url

    from workers.spec import MlflowReport, SpecError, report_paths_outside_run, validate_spec

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    allowed = ["http://mlflow.internal:5000"]
    with listener() as (port, requests):
        crafted = [f"http://127.0.0.1:{port}\\@mlflow.internal:5000",
                   f"http://127.0.0.1:{port}\\@mlflow.internal:5000/",
                   f"http://user:pw@127.0.0.1:{port}\\@mlflow.internal:5000"]
        for uri in crafted:
            assert (parse_url(uri).host, parse_url(uri).port) == ("127.0.0.1", port)  # where the client goes
            try:  # the spec's own check, then the platform's allowlist, then the worker opens the exporter
                report = validate_spec({**SPEC, "report": {"mlflow": {"tracking_uri": uri}}}).report
            except SpecError as err:
                assert [e["field"] for e in err.errors] == ["report.mlflow.tracking_uri"], uri
                continue
            if not report_paths_outside_run(report, allowed):
                open_exporters(report.model_dump(), tmp_path, "unit-run", CONFIG).close(timeout_s=60)
        assert requests == []
        for uri in crafted:  # the allowlist on its own (a report built without the spec's check) refuses it too
            unchecked = ReportSpec.model_construct(mlflow=MlflowReport.model_construct(tracking_uri=uri))
            assert [e["field"] for e in report_paths_outside_run(unchecked, allowed)] == ["report.mlflow.tracking_uri"]


@pytest.mark.parametrize("uri", [
    "http://mlflow.internal:5000\\", "http://mlflow.internal:5000 /x", "http://mlflow.internal:5000\t",
    "http://mlflow.internal:5000\x00", "http://ml%66low.internal:5000", "http://user:secret@mlflow.internal:5000",
    "http://%40@mlflow.internal:5000", "http://mlflow.internal:5000?x=1", "http://mlflow.internal:5000#f",
    "http://mlflöw.internal:5000", " http://mlflow.internal:5000", "http://mlflow.internal.:5000",
])
def test_an_mlflow_server_uri_with_credentials_or_characters_parsers_disagree_on_is_refused(uri):
    from workers.spec import SpecError, validate_spec

    with pytest.raises(SpecError) as err:
        validate_spec({**SPEC, "report": {"mlflow": {"tracking_uri": uri}}})
    assert [e["field"] for e in err.value.errors] == ["report.mlflow.tracking_uri"]


def test_an_allowed_origin_must_match_exactly_scheme_host_and_port():
    from workers.spec import report_paths_outside_run

    allowed = ["http://mlflow.internal:5000", "https://other.example"]
    for uri in ("http://MLflow.Internal:5000", "http://mlflow.internal:5000/api/", "https://other.example:443/x"):
        assert report_paths_outside_run(ReportSpec.model_validate({"mlflow": {"tracking_uri": uri}}), allowed) == []
    for uri in ("https://mlflow.internal:5000", "http://mlflow.internal",
                "http://mlflow.internal.evil.example:5000", "http://other.example:443", "http://127.0.0.1:5000"):
        errors = report_paths_outside_run(ReportSpec.model_validate({"mlflow": {"tracking_uri": uri}}), allowed)
        assert [e["field"] for e in errors] == ["report.mlflow.tracking_uri"], uri


def echo_secrets(headers: dict) -> bytes:
    """An error reply that quotes a secret and the request's own credentials back."""
    return f"denied: upstream token=FAKE-SECRET-4242 for {headers.get('Authorization')}".encode()


@pytest.mark.parametrize("content_type, body", [
    ("text/plain", echo_secrets),
    ("application/json", lambda headers: json.dumps(
        {"error_code": "PERMISSION_DENIED", "message": echo_secrets(headers).decode()}).encode()),
])
def test_an_mlflow_servers_error_reply_and_the_workers_credentials_never_reach_the_run_log(
        tmp_path, caplog, monkeypatch, content_type, body):
    """MLflow puts a failed call's reply into its exception; the run's log and result.json
    (which the team reads) get the exception's class, error code and HTTP status only."""
    from workers.spec import report_paths_outside_run

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with listener(status=403, body=body, content_type=content_type) as (port, requests):
        server = f"http://127.0.0.1:{port}"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server)  # the worker's own server: its token is sent there
        monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "operator-token-7777")
        report = ReportSpec.model_validate({"mlflow": {"tracking_uri": server, "experiment": "e"}})
        assert report_paths_outside_run(report, [server]) == []  # an allowed origin
        with caplog.at_level(logging.DEBUG):
            status = open_exporters(report.model_dump(), tmp_path, "unit-run", CONFIG).close(timeout_s=60)
    assert requests and "operator-token-7777" in requests[0]["headers"]["Authorization"]  # it did answer, quoting it
    assert status["mlflow"].startswith("failed (opening): ") and "403" in status["mlflow"], status
    logged = caplog.text + json.dumps(status)
    assert "report.mlflow failed while opening" in logged and "Exception" in logged
    for secret in ("FAKE-SECRET-4242", "operator-token-7777", "denied"):
        assert secret not in logged, secret


def test_a_failure_reason_keeps_the_clients_own_words_and_scrubs_credentials():
    from workers.io.exporters import failure_reason

    assert failure_reason(ValueError("bad experiment name 'x'")) == "ValueError: bad experiment name 'x'"
    reason = failure_reason(RuntimeError("GET https://u:pw@host/x Authorization: Bearer abcdef123456 "
                                         "password=hunter2 key s3cr3t-value"), secrets=("s3cr3t-value",))
    for secret in ("pw@", "abcdef123456", "hunter2", "s3cr3t-value"):
        assert secret not in reason, reason
    assert len(failure_reason(OSError("x" * 5000))) < 300
