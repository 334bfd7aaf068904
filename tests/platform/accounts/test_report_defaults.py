"""A team's default metric exporters (GET/PUT /api/teams/<slug>/report-defaults/): members
read them, admins set them, checked like a spec's `report` section; each run submitted to the
team gets them under its own `report`, field by field; another team sees and gets none."""
from fluxrl.accounts.models import Team
from fluxrl.runs.services import submit_run
from tests.platform.conftest import make_spec

import pytest

URL = "/api/teams/team-a/report-defaults/"


@pytest.fixture(autouse=True)
def allowed_mlflow(settings):
    settings.FLUXRL_MLFLOW_SERVERS = ["https://mlflow.example:5000"]
TEAM_REPORT = {"mlflow": {"tracking_uri": "https://mlflow.example:5000", "experiment": "team-a", "tags": {"t": "a"}},
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
    own = {"mlflow": {"experiment": "mine"}, "tensorboard": None, "wandb": {"project": "p"}}
    run = submit_run(team_a, alice, make_spec(report=own))
    assert run.spec["report"] == {
        "mlflow": {"tracking_uri": "https://mlflow.example:5000", "experiment": "mine", "tags": {"t": "a"}},
        "tensorboard": None, "wandb": {"project": "p"}}
    resolved = run.resolved_spec["report"]  # what the engine is given, defaults filled in
    assert resolved["tensorboard"] is None and resolved["wandb"]["mode"] == "offline"
    assert resolved["mlflow"]["experiment"] == "mine" and resolved["mlflow"]["run_name"] is None

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
                 "report:\n  mlflow: {experiment: from-yaml}\n")
    response = api_a.post("/api/runs/", {"spec": spec_yaml, "team": "team-a"})
    assert response.status_code == 201, response.content
    report = api_a.get(f"/api/runs/{response.json()['id']}/").json()["spec"]["report"]
    assert report["mlflow"] == {**TEAM_REPORT["mlflow"], "experiment": "from-yaml"}
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
        assert "FLUXRL_MLFLOW_SERVERS" in response.content.decode()
        with pytest.raises(InvalidInput) as err:
            submit_run(team_a, alice, make_spec(report={"mlflow": {"tracking_uri": uri}}))
        assert "spec.report.mlflow.tracking_uri" in str(err.value.fields)
    # the listed origin, whatever its case or path; a folder in the run's own output folder always
    assert api_a.put(URL, {"report": {"mlflow": {"tracking_uri": "https://MLflow.Example:5000/api"}}}).status_code == 200
    assert submit_run(team_a, alice, make_spec(name="local", report={"mlflow": {"tracking_uri": "mlruns"}}))
    settings.FLUXRL_MLFLOW_SERVERS = []  # none listed: servers refused, local stores fine
    assert_error(api_a.put(URL, {"report": TEAM_REPORT}), 400, field="report.mlflow.tracking_uri")
