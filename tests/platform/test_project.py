import sys
import sysconfig
from pathlib import Path

from django.conf import settings
from rest_framework.test import APIClient


def test_import_platform_is_still_the_standard_library():
    import platform

    assert Path(platform.__file__).parent == Path(sysconfig.get_paths()["stdlib"])
    assert platform.python_version() == ".".join(map(str, sys.version_info[:3]))


def test_unknown_api_urls_answer_json_404(api_a, assert_error):
    assert_error(api_a.get("/api/nothing-here/"), 404, "not_found")


def test_wrong_method_answers_json_405(api_a, assert_error):
    assert_error(api_a.put("/api/runs/"), 405, "method_not_allowed")


def test_malformed_json_body_is_400(api_a, assert_error):
    assert_error(api_a.post("/api/runs/", "{not json", content_type="application/json"), 400, "parse_error")


def test_openapi_schema_and_docs_are_served_without_internet(db):
    client = APIClient()
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    assert {"/api/runs/{run_id}/metrics/", "/api/datasets/", "/api/rewards/try/"} <= set(paths)
    docs = client.get("/api/docs/").content.decode()
    assert "swagger-ui" in docs and "cdn" not in docs.lower()


def test_celery_is_configured_for_long_runs_on_cpu_and_gpu_queues():
    from fluxrl.celery import app

    conf = app.conf
    assert conf.task_acks_late is True and conf.worker_prefetch_multiplier == 1
    assert conf.broker_transport_options["visibility_timeout"] == 24 * 3600
    assert conf.task_default_queue == "cpu"
    assert app.amqp.router.route({}, "fluxrl.runs.tasks.gpu_execute_run")["queue"].name == "gpu"
    assert settings.CHANNEL_LAYERS["default"]["BACKEND"].startswith("channels")
