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


def test_nul_characters_in_json_are_400_not_a_database_error(api_a, spec, assert_error):
    assert_error(api_a.post("/api/runs/", {"spec": spec(name="a\x00b")}), 400, "parse_error")


def test_openapi_schema_and_docs_are_served_without_internet(alice):
    client = APIClient()
    client.force_authenticate(alice)  # the schema is for signed-in users (tests/platform/api/test_request_limits.py)
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    assert {"/api/runs/{id}/metrics/", "/api/datasets/", "/api/rewards/try/"} <= set(paths)
    assert paths["/api/runs/{id}/status/"]["post"]["responses"]["409"]["content"]
    docs = client.get("/api/docs/").content.decode()
    assert "swagger-ui" in docs and "cdn" not in docs.lower()


def test_celery_is_configured_for_long_runs_on_cpu_and_gpu_queues():
    from fluxrl.celery import app

    conf = app.conf
    assert conf.task_acks_late is True and conf.worker_prefetch_multiplier == 1
    assert conf.broker_transport_options["visibility_timeout"] == 24 * 3600
    assert conf.task_default_queue == "cpu"
    router = app.amqp.router
    assert router.route({}, "fluxrl.runs.tasks.reap_stale_runs")["queue"].name == "cpu"
    # a run's queue is its spec's (runs.services.enqueue_run passes it), over the routes
    assert router.route({"queue": "gpu"}, "fluxrl.runs.tasks.execute_run")["queue"].name == "gpu"
    assert router.route({"queue": "cpu"}, "fluxrl.runs.tasks.execute_run")["queue"].name == "cpu"
    assert settings.CHANNEL_LAYERS["default"]["BACKEND"].startswith("channels")




def test_asgi_app_serves_api_docs_assets_itself():
    from asgiref.sync import async_to_sync
    from asgiref.testing import ApplicationCommunicator

    from fluxrl.asgi import application

    async def get(path):
        scope = {"type": "http", "http_version": "1.1", "method": "GET", "path": path, "query_string": b"",
                 "headers": [(b"host", b"localhost")], "scheme": "http", "server": ("localhost", 80)}
        app = ApplicationCommunicator(application, scope)
        await app.send_input({"type": "http.request", "body": b""})
        start, body, message = await app.receive_output(10), b"", {"more_body": True}
        while message.get("more_body"):
            message = await app.receive_output(10)
            body += message.get("body", b"")
        return start["status"], body

    status, body = async_to_sync(get)("/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui.css")
    assert status == 200 and b"swagger" in body[:5000].lower()


def test_admin_pages_render_for_every_model(admin_client, run_a, alice):
    from django.contrib import admin

    for model in admin.site._registry:
        meta = model._meta
        if meta.app_label in {"accounts", "datasets", "rewards", "runs", "metrics"}:
            assert admin_client.get(f"/admin/{meta.app_label}/{meta.model_name}/").status_code == 200, meta.label
    assert admin_client.get(f"/admin/runs/run/{run_a.id}/change/").status_code == 200
