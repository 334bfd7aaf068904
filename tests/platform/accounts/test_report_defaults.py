"""A team's default metric exporters (GET/PUT /api/teams/<slug>/report-defaults/): members
read them, admins set them, checked like a spec's `report` section; each run submitted to the
team gets them under its own `report`, field by field; another team sees and gets none."""
from fluxrl.accounts.models import Team
from fluxrl.runs.services import submit_run
from tests.http_listener import listener
from tests.platform.conftest import make_spec

import pytest

URL = "/api/teams/team-a/report-defaults/"


@pytest.fixture(autouse=True)
def allowed_mlflow(settings):
    settings.FLUXRL_MLFLOW_SERVERS = ["https://mlflow.example:5000"]
TEAM_REPORT = {"mlflow": {"tracking_uri": "https://mlflow.example:5000", "experiment": "team-a/main", "tags": {"t": "a"}},
               "tensorboard": {}}


def test_an_admin_sets_the_defaults_and_a_member_reads_them(api_a, api_bob, team_a):
    assert api_bob.get(URL).json() == {"team": "team-a", "report": {}}
    response = api_a.put(URL, {"report": {**TEAM_REPORT, "wandb": None}})  # null: no default for wandb
    assert response.status_code == 200, response.content
    assert response.json() == {"team": "team-a", "report": TEAM_REPORT}
    assert api_bob.get(URL).json()["report"] == TEAM_REPORT
    team_a.refresh_from_db()
    assert team_a.report_defaults == TEAM_REPORT
    assert api_a.put(URL, {"report": {}}).json()["report"] == {}  # cleared


def test_only_an_admin_with_a_write_token_may_change_them(api_bob, alice, client_for, assert_error, team_a):
    assert_error(api_bob.put(URL, {"report": TEAM_REPORT}), 403, "permission_denied")
    read_only = client_for(alice, scopes=["read"])
    assert read_only.get(URL).status_code == 200
    assert_error(read_only.put(URL, {"report": TEAM_REPORT}), 403)
    team_a.refresh_from_db()
    assert team_a.report_defaults == {}


def test_bad_defaults_are_refused_naming_the_field(api_a, assert_error):
    assert_error(api_a.put(URL, {"report": {"tensorboard": {"folder": "x"}}}), 400, field="report.tensorboard.folder")
    assert_error(api_a.put(URL, {"report": {"wandb": {"mode": "cloud"}}}), 400, field="report.wandb.mode")
    assert_error(api_a.put(URL, {"report": {"swanlab": {}}}), 400, field="report.swanlab")
    assert_error(api_a.put(URL, {"report": ["tensorboard"]}), 400, field="report")
    # a run writes only inside its own folder, or to an MLflow server
    assert_error(api_a.put(URL, {"report": {"tensorboard": {"dir": "/srv/tb"}}}), 400, field="report.tensorboard.dir")
    assert_error(api_a.put(URL, {"report": {"mlflow": {"tracking_uri": "file:///srv/mlruns"}}}), 400,
                 field="report.mlflow.tracking_uri")


def test_another_teams_defaults_are_404_to_read_and_to_write(api_a, api_b, carol, alice, team_a, team_b,
                                                             client_for, make_member, assert_error):
    assert api_a.put(URL, {"report": TEAM_REPORT}).status_code == 200
    assert_error(api_b.get(URL), 404, "not_found")
    assert_error(api_b.put(URL, {"report": {"tensorboard": {"dir": "carol"}}}), 404)
    # a member of both teams, with a token bound to team-b, sees team-b's only
    make_member("alice", team_b)
    bound = client_for(alice, team=team_b)
    assert_error(bound.get(URL), 404)
    assert bound.get("/api/teams/team-b/report-defaults/").json() == {"team": "team-b", "report": {}}
    team_a.refresh_from_db()
    assert team_a.report_defaults == TEAM_REPORT


def test_a_run_gets_its_teams_defaults_under_its_own_report_field_by_field(team_a, alice):
    Team.objects.filter(pk=team_a.pk).update(report_defaults=TEAM_REPORT)
    team_a.refresh_from_db()
    own = {"mlflow": {"experiment": "team-a/mine"}, "tensorboard": None, "wandb": {"project": "p"}}
    run = submit_run(team_a, alice, make_spec(report=own))
    assert run.spec["report"] == {
        "mlflow": {"tracking_uri": "https://mlflow.example:5000", "experiment": "team-a/mine", "tags": {"t": "a"}},
        "tensorboard": None, "wandb": {"project": "p"}}
    resolved = run.resolved_spec["report"]  # what the engine is given, defaults filled in
    assert resolved["tensorboard"] is None and resolved["wandb"]["mode"] == "offline"
    assert resolved["mlflow"]["experiment"] == "team-a/mine" and resolved["mlflow"]["run_name"] is None

    plain = submit_run(team_a, alice, make_spec(name="plain"))  # no report of its own: the team's
    assert plain.spec["report"] == TEAM_REPORT
    assert plain.resolved_spec["report"]["tensorboard"] == {"dir": "tensorboard"}
    switched = submit_run(team_a, alice, make_spec(name="on", report={"tensorboard": True, "mlflow": False}))
    assert switched.spec["report"] == {"tensorboard": {}, "mlflow": False}
    assert switched.resolved_spec["report"]["mlflow"] is None


def test_a_run_of_another_team_gets_none_of_them(api_a, api_b, team_b):
    assert api_a.put(URL, {"report": TEAM_REPORT}).status_code == 200
    response = api_b.post("/api/runs/", {"spec": make_spec(name="b-run"), "team": "team-b"})
    assert response.status_code == 201, response.content
    body = api_b.get(f"/api/runs/{response.json()['id']}/").json()
    assert body["spec"].get("report") is None


def test_a_submitted_yaml_spec_is_merged_and_a_report_outside_the_run_folder_refused(api_a, assert_error):
    assert api_a.put(URL, {"report": TEAM_REPORT}).status_code == 200
    spec_yaml = ("name: yaml-run\nmodel: {path: 'builtin:tiny'}\ntask: {dataset: 'gen:add'}\n"
                 "report:\n  mlflow: {experiment: team-a/from-yaml}\n")
    response = api_a.post("/api/runs/", {"spec": spec_yaml, "team": "team-a"})
    assert response.status_code == 201, response.content
    report = api_a.get(f"/api/runs/{response.json()['id']}/").json()["spec"]["report"]
    assert report["mlflow"] == {**TEAM_REPORT["mlflow"], "experiment": "team-a/from-yaml"}
    assert report["tensorboard"] == {}
    assert_error(api_a.post("/api/runs/", {"spec": make_spec(report={"wandb": {"dir": "../../elsewhere"}}),
                                           "team": "team-a"}), 400, field="spec.report.wandb.dir")


def test_an_mlflow_server_the_deployment_does_not_list_is_refused_for_defaults_and_runs(
        api_a, team_a, alice, assert_error, settings):
    """A worker posts to the tracking URI from inside the cluster: only the operator's
    FLUXRL_MLFLOW_SERVERS may be named, never an address a team picks."""
    from fluxrl.errors import InvalidInput

    for uri in ("https://169.254.169.254/latest", "http://mlflow.example:5000", "https://mlflow.example:5001",
                "https://evil@internal-api:5000", "https://redis.internal:6379"):
        response = api_a.put(URL, {"report": {"mlflow": {"tracking_uri": uri}}})
        assert_error(response, 400, field="report.mlflow.tracking_uri")
        assert ("FLUXRL_MLFLOW_SERVERS" if "@" not in uri else "credentials") in response.content.decode()
        with pytest.raises(InvalidInput) as err:
            submit_run(team_a, alice, make_spec(report={"mlflow": {"tracking_uri": uri}}))
        assert "spec.report.mlflow.tracking_uri" in str(err.value.fields)
    # the listed origin, whatever its case or path; a folder in the run's own output folder always
    assert api_a.put(URL, {"report": {"mlflow": {"tracking_uri": "https://MLflow.Example:5000/api"}}}).status_code == 200
    assert submit_run(team_a, alice, make_spec(name="local", report={"mlflow": {"tracking_uri": "mlruns"}}))
    settings.FLUXRL_MLFLOW_SERVERS = []  # none listed: servers refused, local stores fine
    assert_error(api_a.put(URL, {"report": TEAM_REPORT}), 400, field="report.mlflow.tracking_uri")


def test_a_tracking_uri_the_http_client_reads_as_another_host_is_refused_for_defaults_and_runs(
        api_a, team_a, alice, assert_error, settings, monkeypatch, tmp_path):
    """urlsplit reads 'http://127.0.0.1:P\\@mlflow.internal:5000' as the listed server;
    urllib3, which MLflow's client connects with, reads 127.0.0.1:P. Refused where it is
    given, so no worker ever posts to the listener."""
    from fluxrl.errors import InvalidInput
    from workers.io.exporters import open_exporters

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    settings.FLUXRL_MLFLOW_SERVERS = ["http://mlflow.internal:5000"]
    with listener() as (port, requests):
        uri = f"http://127.0.0.1:{port}\\@mlflow.internal:5000"
        report = {"mlflow": {"tracking_uri": uri, "experiment": "team-a/x"}}
        response = api_a.put(URL, {"report": report})
        assert_error(response, 400, field="report.mlflow.tracking_uri")
        try:
            run = submit_run(team_a, alice, make_spec(report=report))
        except InvalidInput as err:
            assert "spec.report.mlflow.tracking_uri" in err.fields
        else:  # what a worker would then do with it
            open_exporters(run.resolved_spec["report"], tmp_path, run.name, {}).close(timeout_s=60)
            pytest.fail("submitted")
        finally:
            team_a.refresh_from_db()
            assert team_a.report_defaults == {}
        response = api_a.post("/api/runs/", {"spec": make_spec(name="api", report=report), "team": "team-a"})
        assert_error(response, 400, field="spec.report.mlflow.tracking_uri")
        for credentials in ("http://user:pw@mlflow.internal:5000", "http://mlflow.internal:5000?token=t"):
            assert_error(api_a.put(URL, {"report": {"mlflow": {"tracking_uri": credentials}}}), 400,
                         field="report.mlflow.tracking_uri")
    assert requests == []


@pytest.fixture
def shared_trackers(settings):
    settings.FLUXRL_MLFLOW_EXPERIMENT_PREFIX = "{team}/"
    settings.FLUXRL_WANDB_PROJECT_PREFIX = "{team}."
    settings.FLUXRL_WANDB_ENTITY = "acme-ml"


@pytest.mark.parametrize("report, field", [
    ({"mlflow": {"tracking_uri": "https://mlflow.example:5000", "experiment": "team-b/secret"}},
     "report.mlflow.experiment"),
    ({"mlflow": {"experiment": "TEAM-B/secret"}}, "report.mlflow.experiment"),  # the workers' own MLFLOW_TRACKING_URI
    ({"mlflow": {"experiment": "team-a"}}, "report.mlflow.experiment"),
    ({"wandb": {"mode": "online", "project": "team-b.runs"}}, "report.wandb.project"),
    ({"wandb": {"mode": "online", "project": "team-a.x", "entity": "team-b-org"}}, "report.wandb.entity"),
])
def test_a_run_or_a_teams_defaults_may_not_name_another_teams_tracker_namespace(
        shared_trackers, api_a, team_a, alice, assert_error, report, field):
    from fluxrl.errors import InvalidInput

    response = api_a.put(URL, {"report": report})
    assert_error(response, 400, field=field)
    assert ("team-a" if "entity" not in field else "acme-ml") in response.json()["error"]["fields"][field]
    with pytest.raises(InvalidInput) as err:
        submit_run(team_a, alice, make_spec(report=report))
    assert list(err.value.fields) == [f"spec.{field}"]
    assert_error(api_a.post("/api/runs/", {"spec": make_spec(name="api", report=report), "team": "team-a"}), 400,
                 field=f"spec.{field}")


def test_tracker_names_a_run_leaves_out_are_its_teams_and_its_own_folder_is_free(shared_trackers, team_a, alice):
    run = submit_run(team_a, alice, make_spec(report={"mlflow": True, "wandb": {"mode": "online"}}))
    assert run.spec["report"] == {"mlflow": {"experiment": "team-a/fluxrl"},
                                  "wandb": {"mode": "online", "project": "team-a.fluxrl", "entity": "acme-ml"}}
    assert run.resolved_spec["report"]["mlflow"]["experiment"] == "team-a/fluxrl"
    assert run.resolved_spec["report"]["wandb"]["project"] == "team-a.fluxrl"
    named = submit_run(team_a, alice, make_spec(name="named", report={
        "mlflow": {"tracking_uri": "https://mlflow.example:5000", "experiment": "team-a/ablation"},
        "wandb": {"mode": "online", "project": "team-a.sweep", "entity": "ACME-ML"}}))
    assert named.resolved_spec["report"]["mlflow"]["experiment"] == "team-a/ablation"
    # the same spec submitted again (a clone) means the same: nothing is prefixed twice
    again = submit_run(team_a, alice, {**run.spec, "name": "again"})
    assert again.spec["report"] == run.spec["report"]
    # a local MLflow store and an offline W&B run are the run's own files: any names
    own = submit_run(team_a, alice, make_spec(name="own", report={
        "mlflow": {"tracking_uri": "mlruns", "experiment": "anything"}, "wandb": {"project": "p", "entity": "me"}}))
    assert own.spec["report"]["mlflow"] == {"tracking_uri": "mlruns", "experiment": "anything"}
    assert own.resolved_spec["report"]["wandb"]["project"] == "p"


def test_a_team_default_experiment_inside_the_namespace_is_kept_and_unset_settings_set_no_rule(
        shared_trackers, api_a, team_a, alice, settings):
    assert api_a.put(URL, {"report": {"mlflow": {"experiment": "team-a/main"}}}).status_code == 200
    team_a.refresh_from_db()
    assert submit_run(team_a, alice, make_spec()).spec["report"]["mlflow"] == {"experiment": "team-a/main"}
    settings.FLUXRL_MLFLOW_EXPERIMENT_PREFIX = settings.FLUXRL_WANDB_PROJECT_PREFIX = settings.FLUXRL_WANDB_ENTITY = ""
    free = {"mlflow": {"experiment": "anything"}, "wandb": {"mode": "online", "project": "p", "entity": "e"}}
    assert submit_run(team_a, alice, make_spec(name="free", report=free)).spec["report"] == free
