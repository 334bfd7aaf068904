"""The new-run form's report section (workers/spec/report.py ReportSpec): each exporter is a JSON
field, and a cloned run's exporters come back whole, {} (on, with defaults) included."""
import json

from fluxrl.dashboard.services import flatten, spec_form


def report_fields(initial=None) -> dict:
    section = next(s for s in spec_form(initial) if s["section"] == "report")
    return {f["name"]: f for f in section["fields"]}


def test_each_exporter_is_a_json_field_left_empty_by_default():
    fields = report_fields()
    assert sorted(fields) == ["report.mlflow", "report.tensorboard", "report.wandb"]
    assert all(f["type"] == "json" and f["value"] == "" for f in fields.values())


def test_a_cloned_runs_exporters_come_back_whole():
    spec = {"report": {"tensorboard": {}, "mlflow": {"experiment": "e", "tags": {"team": "blue"}}, "wandb": None}}
    fields = report_fields(flatten(spec))
    assert json.loads(fields["report.tensorboard"]["value"]) == {}
    assert json.loads(fields["report.mlflow"]["value"]) == {"experiment": "e", "tags": {"team": "blue"}}
    assert fields["report.wandb"]["value"] == ""
