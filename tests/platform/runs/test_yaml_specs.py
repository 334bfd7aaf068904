"""POST /api/runs/ with a YAML body (README: `curl -H 'Content-Type: application/yaml'
--data-binary @examples/add-async.yaml`): the same runs, limits and per-field errors as JSON."""
import time
from pathlib import Path

import pytest
import yaml

from fluxrl.runs.models import Run

EXAMPLE = Path(__file__).parents[3] / "examples" / "add-async.yaml"
MEDIA_TYPES = ["application/yaml", "application/x-yaml", "text/yaml"]


def post_yaml(client, body, media_type="application/yaml"):
    return client.post("/api/runs/", body.encode() if isinstance(body, str) else body, content_type=media_type)


@pytest.mark.parametrize("media_type", [*MEDIA_TYPES, "application/yaml; charset=utf-8"])
def test_a_spec_file_posted_as_yaml_is_the_same_run_as_json(api_a, media_type):
    as_json = api_a.post("/api/runs/", {"spec": yaml.safe_load(EXAMPLE.read_text())}, format="json")
    as_yaml = post_yaml(api_a, EXAMPLE.read_bytes(), media_type)
    assert (as_json.status_code, as_yaml.status_code) == (201, 201), as_yaml.content
    for key in ("spec", "resolved_spec", "name", "status", "team", "dataset", "reward"):
        assert as_yaml.json()[key] == as_json.json()[key], key
    stored = Run.objects.get(pk=as_yaml.json()["id"])
    assert stored.spec == Run.objects.get(pk=as_json.json()["id"]).spec == yaml.safe_load(EXAMPLE.read_text())


def test_a_yaml_envelope_sets_tags_notes_and_team(api_a, team_a):
    body = f"team: {team_a.slug}\ntags: [yaml, demo]\nnotes: from a file\nspec:\n" + "".join(
        f"  {line}\n" for line in EXAMPLE.read_text().splitlines())
    response = post_yaml(api_a, body)
    assert response.status_code == 201, response.content
    assert (response.json()["tags"], response.json()["notes"]) == (["demo", "yaml"], "from a file")
    assert response.json()["spec"] == yaml.safe_load(EXAMPLE.read_text())


@pytest.mark.parametrize(
    "extra, field",
    [
        ("trainer: {lr: 0.1}\n", "spec.trainer.lr"),
        ("schedule: {mode: sometimes}\n", "spec.schedule.mode"),
        ("spec: {name: x}\n", "spec.spec"),  # a spec naming `spec` is still a spec, not an envelope
    ],
)
def test_a_wrong_field_in_yaml_is_400_naming_it_as_json_would(api_a, assert_error, extra, field):
    text = EXAMPLE.read_text().replace("schedule: {mode: async, max_staleness: 2, batch_prompts: 16}\n", "") + extra
    error = assert_error(post_yaml(api_a, text), 400, "invalid", field=field)
    assert field in error["message"]
    assert not Run.objects.exists()


@pytest.mark.parametrize("body", ["- name: a\n- name: b\n", "just text\n", "42\n", "~\n", "# only a comment\n"])
def test_a_yaml_body_that_is_not_a_mapping_is_400(api_a, assert_error, body):
    error = assert_error(post_yaml(api_a, body), 400, "parse_error")
    assert "must be a YAML mapping" in error["message"]


def test_a_yaml_syntax_error_is_400_naming_the_line(api_a, assert_error):
    body = "name: a\nmodel: {path: ./m}\ntask: {dataset: [gen:add}\n"
    error = assert_error(post_yaml(api_a, body), 400, "parse_error")
    assert "line 3" in error["message"], error


@pytest.mark.parametrize("body", [
    "name: x\nmodel: &m {path: ./m}\ntask: {dataset: 'gen:add'}\n",  # an anchor alone, unused
    "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(  # billion laughs
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(9)),
])
def test_yaml_anchors_and_aliases_are_refused_without_expanding(api_a, assert_error, body):
    started = time.monotonic()
    error = assert_error(post_yaml(api_a, body), 400, "parse_error")
    assert "aliases are not allowed" in error["message"] and time.monotonic() - started < 5


def test_a_yaml_body_over_the_limit_is_413_like_json(api_a, settings, assert_error):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000  # the one limit of JSON bodies here
    text = EXAMPLE.read_text() + "".join(f"# padding {i}\n" for i in range(100))
    assert_error(api_a.post("/api/runs/", {"spec": text}, format="json"), 413, "too_large")
    assert_error(post_yaml(api_a, text), 413, "too_large")
    assert not Run.objects.exists()


@pytest.mark.parametrize("body, words", [
    (b"name: a\x00b\nmodel: {path: ./m}\n", "NUL"),
    (b'name: "a\\0b"\nmodel: {path: ./m}\n', "NUL"),  # an escaped NUL: PostgreSQL text cannot hold it
    (b"name: caf\xe9\nmodel: {path: ./m}\n", "UTF-8"),
    (b"name: 2024-01-01\nmodel: {path: ./m}\n", "quote it"),  # a YAML date, which JSON has not
    (b"name: x\nmodel: {path: !!binary aGk=}\n", "quote it"),
    (b"name: x\n1: y\n", "keys must be strings"),
    (b"name: x\ntrainer: {lr: .nan}\n", ".nan"),
    (b"name: !!python/object:os.system x\n", "line 1"),  # safe_load: no Python objects
    (b"name: a\n---\nname: b\n", "YAML syntax error"),  # one document per run
    (b"[" * 5000 + b"]" * 5000, "nested"),  # deeper than safe_load's recursion could go
])
def test_yaml_that_json_could_not_carry_is_400(api_a, assert_error, body, words):
    error = assert_error(post_yaml(api_a, body), 400, "parse_error")
    assert words in error["message"], error
    assert not Run.objects.exists()


def test_the_schema_lists_the_yaml_media_types(api_a):
    schema = yaml.safe_load(api_a.get("/api/schema/").content)
    content = schema["paths"]["/api/runs/"]["post"]["requestBody"]["content"]
    assert set(content) == {"application/json", *MEDIA_TYPES}
