"""Per-team quotas: live runs, engines and nodes across them, stored
bytes and files; deployment defaults (FLUXRL_QUOTA_*) that an admin overrides per team
(TeamQuota), and per-run ceilings checked with the spec. Refusals name what is used and
what is allowed, and leave nothing behind."""
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from fluxrl.datasets.models import DatasetVersion
from fluxrl.modelstore.models import StoredModelVersion
from fluxrl.quotas.models import TeamQuota
from fluxrl.runs.models import Run, RunStatus
from fluxrl.runs.services import cancel_run, submit_run, transition
from tests.platform.model_archives import RM, folder_files, tar_gz


def post_run(client, spec, **sections):
    return client.post("/api/runs/", {"spec": spec(**sections)}, format="json")


def test_the_runs_quota_counts_queued_and_running_runs_and_names_the_numbers(api_a, team_a, alice, spec, settings,
                                                                              assert_error):
    settings.FLUXRL_QUOTA_RUNS = 3
    first = submit_run(team_a, alice, spec())
    transition(first, RunStatus.STARTING)
    transition(first, RunStatus.RUNNING)
    for _ in range(2):
        assert post_run(api_a, spec).status_code == 201
    error = assert_error(post_run(api_a, spec), 403, "quota_exceeded", field="team")
    assert "3 of 3 concurrent runs in use" in error["message"] and "FLUXRL_QUOTA_RUNS" in error["message"]
    assert Run.objects.filter(team=team_a).count() == 3
    cancel_run(first)  # asked to stop, it still runs: still counted
    assert post_run(api_a, spec).status_code == 403
    transition(first, RunStatus.CANCELLED)  # ended: its slot is free
    assert post_run(api_a, spec).status_code == 201


def test_engines_and_nodes_over_the_teams_remaining_quota_are_refused(api_a, spec, settings, assert_error):
    settings.FLUXRL_QUOTA_ENGINES, settings.FLUXRL_QUOTA_NODES = 6, 3
    assert post_run(api_a, spec, rollout={"engines": 4}, resources={"nodes": 2, "trainer_ranks": 2}).status_code == 201
    error = assert_error(post_run(api_a, spec, rollout={"engines": 3}), 403, "quota_exceeded",
                         field="spec.rollout.engines")
    assert "4 of 6 rollout engines in use" in error["message"] and "asks for 3" in error["message"]
    error = assert_error(post_run(api_a, spec, resources={"nodes": 2, "trainer_ranks": 2}), 403, "quota_exceeded",
                         field="spec.resources.nodes")
    assert "2 of 3 nodes in use" in error["message"] and "FLUXRL_QUOTA_NODES" in error["message"]
    assert post_run(api_a, spec, rollout={"engines": 2}).status_code == 201  # exactly what is left fits
    assert Run.objects.count() == 2


@pytest.mark.parametrize("section, field, setting", [
    ({"rollout": {"engines": 4096}}, "spec.rollout.engines", "FLUXRL_MAX_ENGINES_PER_RUN"),
    ({"resources": {"nodes": 1024, "trainer_ranks": 1024}}, "spec.resources.nodes", "FLUXRL_MAX_NODES_PER_RUN"),
])
def test_a_spec_over_the_deployments_per_run_ceiling_is_400_naming_the_field(api_a, spec, assert_error, section,
                                                                              field, setting):
    error = assert_error(post_run(api_a, spec, **section), 400, "invalid", field=field)
    assert setting in error["fields"][field]
    assert not Run.objects.exists()


def test_an_admin_set_team_quota_overrides_the_deployment_default(api_a, api_b, team_a, spec, settings, assert_error):
    settings.FLUXRL_QUOTA_RUNS = 1
    TeamQuota.objects.create(team=team_a, max_runs=2)
    assert [post_run(api_a, spec).status_code for _ in range(2)] == [201, 201]
    error = assert_error(post_run(api_a, spec), 403, "quota_exceeded")
    assert "2 of 2 concurrent runs" in error["message"] and "the team's quota" in error["message"]
    # team B has no row of its own: the default
    assert [post_run(api_b, spec).status_code for _ in range(2)] == [201, 403]
    # and an admin may also lower a team below the default
    TeamQuota.objects.filter(team=team_a).update(max_runs=None, max_storage_bytes=0)
    quota = api_a.get("/api/teams/team-a/quota/").json()
    assert quota["runs"] == {"used": 2, "limit": 1, "source": "FLUXRL_QUOTA_RUNS, the deployment default"}
    assert quota["storage_bytes"]["limit"] == 0 and "the team's quota" in quota["storage_bytes"]["source"]


def test_resuming_a_run_counts_against_the_runs_quota(api_a, team_a, alice, spec, settings, assert_error):
    settings.FLUXRL_QUOTA_RUNS = 1
    stopped = submit_run(team_a, alice, spec())
    stopped.checkpoints.create(step=1, version=1, path="x")
    cancel_run(stopped)
    assert post_run(api_a, spec).status_code == 201
    assert_error(api_a.post(f"/api/runs/{stopped.pk}/resume/"), 403, "quota_exceeded")
    assert Run.objects.get(pk=stopped.pk).status == RunStatus.CANCELLED


def test_a_dataset_upload_over_the_storage_quota_is_413_and_stores_nothing(api_a, team_a, settings, data_dir,
                                                                            assert_error):
    rows = b"".join(b'{"prompt": "%d+1=", "answer": "%d"}\n' % (i, i + 1) for i in range(100))
    first = api_a.post("/api/datasets/", {"file": SimpleUploadedFile("a.jsonl", rows), "name": "a"}, format="multipart")
    assert first.status_code == 201
    used = first.json()["size_bytes"]
    settings.FLUXRL_QUOTA_STORAGE_BYTES = used + 100
    response = api_a.post("/api/datasets/", {"file": SimpleUploadedFile("b.jsonl", rows), "name": "b"},
                          format="multipart")
    error = assert_error(response, 413, "quota_exceeded", field="file")
    assert f"{used} of {used + 100} bytes stored and this upload adds {used}" in error["message"]
    assert "FLUXRL_QUOTA_STORAGE_MB" in error["message"]
    assert DatasetVersion.objects.count() == 1 and len(list((data_dir / "datasets").rglob("*.jsonl"))) == 1
    # generated data is stored data too; and the files quota
    settings.FLUXRL_QUOTA_STORAGE_BYTES, settings.FLUXRL_QUOTA_FILES = None, 1
    response = api_a.post("/api/datasets/generate/", {"name": "g", "generator": "add", "n": 5}, format="json")
    assert "1 of 1 files stored" in assert_error(response, 413, "quota_exceeded")["message"]


def test_a_model_upload_over_the_storage_quota_is_413_and_stores_nothing(api_a, team_a, settings, data_dir,
                                                                          assert_error):
    files = folder_files(RM)
    TeamQuota.objects.create(team=team_a, max_storage_bytes=sum(map(len, files.values())) - 1)
    response = api_a.post("/api/models/", {"file": SimpleUploadedFile("rm.tar.gz", tar_gz(files)), "name": "rm"},
                          format="multipart")
    error = assert_error(response, 413, "quota_exceeded", field="file")
    assert f"0 of {sum(map(len, files.values())) - 1} bytes stored" in error["message"]
    assert "the team's quota" in error["message"]
    assert not StoredModelVersion.objects.exists()
    assert not [p for p in (data_dir / "team-models").rglob("*") if p.is_file()]
    TeamQuota.objects.filter(team=team_a).update(max_storage_bytes=None, max_files=len(files) - 1)
    response = api_a.post("/api/models/", {"file": SimpleUploadedFile("rm.tar.gz", tar_gz(files)), "name": "rm"},
                          format="multipart")
    assert f"0 of {len(files) - 1} files stored and this upload adds {len(files)}" in \
        assert_error(response, 413, "quota_exceeded")["message"]


def test_the_quota_endpoint_shows_use_and_limits_to_members_only(api_a, api_b, team_a, alice, spec, settings):
    settings.FLUXRL_MAX_ENGINES_PER_RUN = 8
    submit_run(team_a, alice, spec(rollout={"engines": 3}))
    response = api_a.post("/api/datasets/", {"file": SimpleUploadedFile("a.jsonl", b'{"prompt": "p", "answer": 1}\n'),
                                             "name": "a"}, format="multipart")
    quota = api_a.get("/api/teams/team-a/quota/").json()
    assert (quota["runs"]["used"], quota["engines"]["used"], quota["nodes"]["used"]) == (1, 3, 1)
    assert (quota["storage_bytes"]["used"], quota["files"]["used"]) == (response.json()["size_bytes"], 1)
    assert quota["per_run"]["engines"] == 8
    assert api_b.get("/api/teams/team-a/quota/").status_code == 404  # not a member: as if it did not exist
    assert api_a.post("/api/teams/team-a/quota/", {}).status_code == 405  # read-only: an admin sets quotas


def test_a_platform_admin_sets_a_teams_quota_in_the_django_admin(admin_client, api_a, team_a, spec, assert_error):
    page = admin_client.post("/admin/quotas/teamquota/add/", {"team": team_a.pk, "max_runs": 1})
    assert page.status_code == 302, page.content.decode()[-2000:]
    assert admin_client.get("/admin/quotas/teamquota/").status_code == 200
    assert post_run(api_a, spec).status_code == 201
    assert "1 of 1 concurrent runs in use" in assert_error(post_run(api_a, spec), 403, "quota_exceeded")["message"]
