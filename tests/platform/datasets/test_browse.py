import json

from fluxrl.datasets.models import DatasetVersion
from workers.tasks.datasets import generate


def test_generators_are_listed_with_their_parameters(api_a):
    generators = {g["name"]: g for g in api_a.get("/api/datasets/generators/").json()}
    assert set(generators) == {"add", "chain", "countdown", "tool_arith", "guess_number"}
    assert generators["add"]["params"] == {"max_digits": 3}
    assert generators["tool_arith"]["params"] == {"digits_a": 3, "digits_b": 2}


def test_generate_creates_a_version_equal_to_the_engine_generator(api_a):
    response = api_a.post("/api/datasets/generate/", {"generator": "countdown", "name": "cd", "n": 25, "seed": 7,
                                                      "params": {"numbers": 4}})
    assert response.status_code == 201, response.content
    version = DatasetVersion.objects.get()
    rows = [json.loads(line) for line in version.path.read_text().splitlines()]
    assert rows == generate("countdown", 25, seed=7, numbers=4)
    assert response.json()["generator"] == {"name": "countdown", "n": 25, "seed": 7, "params": {"numbers": 4}}


def test_generate_rejects_unknown_generators_and_parameters(api_a, assert_error):
    assert_error(api_a.post("/api/datasets/generate/", {"generator": "nope", "name": "x"}), 400, field="generator")
    assert_error(api_a.post("/api/datasets/generate/", {"generator": "add", "name": "x", "params": {"bogus": 1}}),
                 400, field="params")
    assert_error(api_a.post("/api/datasets/generate/", {"generator": "add", "name": "x", "n": 0}), 400, field="n")


def test_preview_pages_through_rows(api_a, dataset_a):
    url = f"/api/datasets/{dataset_a.dataset_id}/versions/1/preview/"
    page = api_a.get(url, {"offset": 28, "limit": 5}).json()
    assert page["row_count"] == 30 and len(page["rows"]) == 2
    assert page["rows"][-1] == generate("add", 30, seed=1)[-1]


def test_download_returns_the_stored_file(api_a, dataset_a):
    response = api_a.get(f"/api/datasets/{dataset_a.dataset_id}/versions/1/download/")
    assert response.status_code == 200
    assert b"".join(response.streaming_content) == dataset_a.path.read_bytes()


def test_lists_show_only_my_teams_datasets(api_a, api_b, dataset_a):
    assert [d["name"] for d in api_a.get("/api/datasets/").json()["results"]] == ["add"]
    assert api_b.get("/api/datasets/").json()["results"] == []


def test_another_teams_dataset_and_versions_are_404(api_b, dataset_a, assert_error):
    base = f"/api/datasets/{dataset_a.dataset_id}"
    for url in [f"{base}/", f"{base}/versions/", f"{base}/versions/1/", f"{base}/versions/1/preview/",
                f"{base}/versions/1/download/"]:
        assert_error(api_b.get(url), 404, "not_found")


def test_missing_version_is_404(api_a, dataset_a, assert_error):
    assert_error(api_a.get(f"/api/datasets/{dataset_a.dataset_id}/versions/9/"), 404)


def test_preview_offset_past_any_row_count_is_400_not_a_server_error(api_a, dataset_a, assert_error):
    url = f"/api/datasets/{dataset_a.dataset_id}/versions/1/preview/"
    assert_error(api_a.get(url, {"offset": 2**63}), 400, field="offset")  # found by tests/platform/test_api_fuzz.py
    assert api_a.get(url, {"offset": 2**31 - 1}).json()["rows"] == []
