"""One small request must not take the web process down: YAML alias bombs, width-bomb
prompt templates and deeply nested JSON each get a 400 within a second and without the
process growing (peak RSS sampled with psutil while the request runs); bodies over
FLUXRL_MAX_BODY_MB get a 413 from the ASGI app before Django reads them. Real Django
test client and the real ASGI application, no mocks."""
import contextlib
import os
import threading
import time

import psutil
import pytest
from asgiref.testing import ApplicationCommunicator
from django.core.signals import request_started
from rest_framework.test import APIClient

from fluxrl.asgi import application
from fluxrl.runs.models import Run

MB = 1024 * 1024


@contextlib.contextmanager
def peak_growth():
    """{"mb", "s"}: how far this process' RSS rose above where it started (sampled every
    2 ms in a thread) and how long the block took."""
    process, found, stop = psutil.Process(), {}, threading.Event()
    start_rss = process.memory_info().rss
    peak = [start_rss]

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    began = time.monotonic()
    try:
        yield found
    finally:
        found["s"] = time.monotonic() - began
        stop.set()
        sampler.join()
        found["mb"] = (max(peak[0], process.memory_info().rss) - start_rss) / MB


def alias_bomb(levels: int = 9, fan: int = 10) -> str:
    """~1 KB of YAML that a plain loader expands to fan**levels strings."""
    lines = ['a0: &a0 ["lol"]']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * fan) + "]")
    lines += ["name: bomb", "model: {path: 'builtin:tiny'}", "task: {dataset: 'gen:add'}",
              f"reward: {{function: numeric_match, params: {{x: *a{levels}}}}}"]
    return "\n".join(lines)


def test_an_alias_bomb_spec_string_is_400_fast_and_small(api_a, assert_error):
    text = alias_bomb()
    assert len(text) < 1100
    with peak_growth() as used:
        error = assert_error(api_a.post("/api/runs/", {"spec": text}, format="json"), 400, field="spec")
    assert "anchors and aliases" in error["message"]
    assert used["s"] < 1.0 and used["mb"] < 50, used
    assert not Run.objects.exists()


def test_an_alias_bomb_in_a_prompt_preview_spec_string_is_400(api_a, assert_error):
    with peak_growth() as used:
        assert_error(api_a.post("/api/prompt-preview/", {"spec": alias_bomb()}, format="json"), 400, field="spec")
    assert used["s"] < 1.0 and used["mb"] < 50, used


def test_a_width_bomb_prompt_template_is_400_fast_and_small(api_a, spec, assert_error):
    bomb = spec(task={"dataset": "gen:add", "prompt_template": '{{ "x"|center(100000000) }}'})
    with peak_growth() as used:
        error = assert_error(api_a.post("/api/runs/", {"spec": bomb}, format="json"), 400,
                             field="spec.task.prompt_template")
    assert "center would build more than 100000" in error["message"]
    assert used["s"] < 1.0 and used["mb"] < 50, used


def test_a_prompt_template_is_compiled_in_a_child_process_not_in_the_web_process(api_a, spec, monkeypatch):
    import jinja2

    compiled_here = []
    original = jinja2.Environment.from_string
    monkeypatch.setattr(jinja2.Environment, "from_string", lambda self, *a, **k: compiled_here.append(a) or
                        original(self, *a, **k))
    good = spec(task={"dataset": "gen:add", "prompt_template": "Q: {{ prompt }}\nA:"})
    response = api_a.post("/api/runs/", {"spec": good}, format="json")
    assert response.status_code == 201, response.content
    assert Run.objects.get().spec["task"]["prompt_template"] == "Q: {{ prompt }}\nA:"
    assert compiled_here == []


def test_the_template_child_gets_none_of_the_web_environment(monkeypatch):
    from fluxrl.runs import preview

    monkeypatch.setenv("DATABASE_URL", "postgres://user:secret@db/fluxrl")
    monkeypatch.setenv("DJANGO_SECRET_KEY", "web-secret")
    seen = preview.render_template("{{ env }}", {"env": "x"})
    assert seen == "x"
    # What the child's os.environ holds, read by the child itself through a probe in its place.
    from workers.tasks import template_child

    monkeypatch.setattr(template_child, "_BOOT", "import json, os; print(json.dumps(dict(text=json.dumps("
                                                 "sorted(os.environ)))))")
    names = set(__import__("json").loads(preview.render_template("x", {})))
    assert not names & {"DATABASE_URL", "DJANGO_SECRET_KEY", "REDIS_URL", "FLUXRL_CLUSTER_KEY_SECRET"}, names
    assert names <= set(template_child.CHILD_ENV) | {"PWD", "SHLVL", "_"}, names


@pytest.mark.parametrize("depth,nul", [(5000, False), (1000, False), (400, True)])
def test_deeply_nested_json_is_400_naming_the_body(api_a, assert_error, depth, nul):
    inner = '"\\u0000"' if nul else "1"
    body = '{"spec": ' + "[" * depth + inner + "]" * depth + "}"
    with peak_growth() as used:
        error = assert_error(api_a.post("/api/runs/", body, content_type="application/json"), 400, field="body")
    assert "nested" in error["message"]
    assert used["s"] < 1.0 and used["mb"] < 50, used


def test_a_nested_spec_string_is_400_naming_the_spec(api_a, assert_error):
    text = "[" * 5000 + "]" * 5000
    assert_error(api_a.post("/api/runs/", {"spec": text}, format="json"), 400, field="spec")


def test_json_nested_within_the_limit_is_parsed(api_a, spec):
    nested = 1
    for _ in range(90):
        nested = [nested]
    # 90 levels inside the body: parsed, then refused by the spec's own validation (an unknown field)
    response = api_a.post("/api/runs/", {"spec": {**spec(), "extra": nested}}, format="json")
    assert response.status_code == 400 and list(response.json()["error"]["fields"]) == ["spec.extra"]


# --- the ASGI body cap -------------------------------------------------------------------------


async def asgi_post(body_chunks, content_length: int | None, path: str = "/api/runs/"):
    """A POST through fluxrl.asgi.application; (status, whether Django started the request)."""
    django_saw = []

    def saw(**kwargs):
        django_saw.append(True)

    request_started.connect(saw)
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")]
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    app = ApplicationCommunicator(application, scope)
    try:
        for index, chunk in enumerate(body_chunks):
            await app.send_input({"type": "http.request", "body": chunk, "more_body": index < len(body_chunks) - 1})
        start = await app.receive_output(10)
        body = await app.receive_output(10)
        await app.wait(10)
    finally:
        request_started.disconnect(saw)
    return start["status"], dict(start["headers"]), body.get("body", b""), bool(django_saw)


@pytest.mark.django_db(transaction=True)
def test_a_body_over_the_cap_by_content_length_is_413_before_django(settings):
    from asgiref.sync import async_to_sync

    cap = settings.FLUXRL_MAX_BODY_BYTES
    status, headers, body, django_saw = async_to_sync(asgi_post)([b"{}"], cap + 1)
    assert status == 413 and not django_saw
    assert b"FLUXRL_MAX_BODY_MB" in body


@pytest.mark.django_db(transaction=True)
def test_a_chunked_body_is_cut_off_past_the_cap_before_django(settings):
    from asgiref.sync import async_to_sync

    cap = settings.FLUXRL_MAX_BODY_BYTES
    chunk = b" " * MB
    chunks = [chunk] * (cap // MB + 1) + [b"{}"] * 5
    status, _, _, django_saw = async_to_sync(asgi_post)(chunks, None)
    assert status == 413 and not django_saw


@pytest.mark.django_db(transaction=True)
def test_a_model_upload_has_its_own_larger_cap_and_nothing_else_does(settings):
    from asgiref.sync import async_to_sync

    over_default = settings.FLUXRL_MAX_BODY_BYTES + 1
    assert over_default < settings.FLUXRL_MAX_MODEL_BYTES
    status, _, _, django_saw = async_to_sync(asgi_post)([b"{}"], over_default, "/api/models/")
    assert status == 401 and django_saw  # within FLUXRL_MAX_MODEL_MB: Django answers (no credentials)
    status, _, body, django_saw = async_to_sync(asgi_post)([b"{}"], settings.FLUXRL_MAX_MODEL_BYTES + 2**20 + 1,
                                                           "/api/models/")
    assert status == 413 and not django_saw and b"FLUXRL_MAX_MODEL_MB" in body
    status, _, _, django_saw = async_to_sync(asgi_post)([b"{}"], over_default, "/api/datasets/")
    assert status == 413 and not django_saw


@pytest.mark.django_db(transaction=True)
def test_a_body_under_the_cap_reaches_django(settings):
    from asgiref.sync import async_to_sync

    status, _, _, django_saw = async_to_sync(asgi_post)([b"{}"], 2)
    assert status == 401 and django_saw  # no credentials: Django's answer


def test_the_body_cap_follows_fluxrl_max_body_mb():
    import subprocess
    import sys

    env = {**os.environ, "FLUXRL_MAX_BODY_MB": "0.5"}
    out = subprocess.run([sys.executable, "-c", "import django; django.setup(); from django.conf import settings; "
                          "print(settings.FLUXRL_MAX_BODY_BYTES)"], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.join(os.path.dirname(__file__), "..", "..", "..", "platform"))
    assert out.stdout.split()[-1] == str(MB // 2)


# --- the schema --------------------------------------------------------------------------------


def test_the_openapi_schema_needs_a_signed_in_user(db, api_a, run_a, worker_client):
    anonymous = APIClient().get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert anonymous.status_code == 401
    assert anonymous["WWW-Authenticate"].startswith("Bearer")
    assert worker_client(run_a).get("/api/schema/").status_code == 403  # run tokens only report
    signed_in = api_a.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert signed_in.status_code == 200 and "/api/runs/" in signed_in.json()["paths"]
