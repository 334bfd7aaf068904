"""A Parquet upload and an imported save_to_disk folder train: the same rows as Parquet (other
column names, mapped), as a DatasetDict folder in the team's import folder, and as JSONL become byte-identical versions,
and a run submitted on each version trains on the real engine (vLLM and DeepSpeed on the
tiny model, in this process: the engine-ready spec dispatch would hand the engine)."""
import asyncio
import io
import json

import datasets as hf
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from fluxrl.runs.engine_inputs import resolve_spec
from fluxrl.runs.services import submit_run
from workers.coord.controller import Controller
from workers.spec import validate_spec
from workers.tasks.datasets import generate

ROWS = generate("add", 48, seed=5, max_digits=2)  # {"prompt", "answer", ...} rows the engine can score


def run_spec(dataset_ref: str) -> dict:
    return {"name": "formats", "model": {"path": "builtin:tiny"}, "task": {"dataset": dataset_ref, "eval_size": 8},
            "reward": {"function": "numeric_match"},
            "algorithm": {"loss": "ppo", "group_size": 4, "lr": 1.0e-3},
            "rollout": {"engines": 1, "max_tokens": 16, "update_mode": "keep"},
            "schedule": {"mode": "async", "max_staleness": 1, "batch_prompts": 4},
            "stop": {"max_steps": 2, "max_minutes": 5}, "eval": {"every_steps": 0, "prompts": 8}}


@pytest.fixture
def three_versions(api_a, settings, tmp_path):
    """The rows as JSONL (prompt/answer), as Parquet and as a save_to_disk DatasetDict
    (question/solution): the three stored versions' API bodies."""
    renamed = {"question": [r["prompt"] for r in ROWS], "solution": [r["answer"] for r in ROWS]}
    extra = {k: [r[k] for r in ROWS] for k in ROWS[0] if k not in ("prompt", "answer")}
    settings.FLUXRL_DATASET_IMPORT_ROOT = tmp_path / "imports"
    hf.disable_progress_bars()
    folder = settings.FLUXRL_DATASET_IMPORT_ROOT / "team-a" / "sums"
    table = hf.Dataset.from_dict({**renamed, **extra})
    hf.DatasetDict({"train": table, "test": table.select(range(4))}).save_to_disk(str(folder))
    sink = io.BytesIO()
    pq.write_table(pa.table({**renamed, **extra}), sink, row_group_size=10)
    mapping = {"prompt_field": "question", "answer_field": "solution"}

    jsonl = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    versions = {
        "jsonl": api_a.post("/api/datasets/", {"name": "sums-jsonl", "file": SimpleUploadedFile("s.jsonl", jsonl)},
                            format="multipart"),
        "parquet": api_a.post("/api/datasets/", {"name": "sums-parquet", "file": SimpleUploadedFile(
            "s.parquet", sink.getvalue(), "application/vnd.apache.parquet"), **mapping}, format="multipart"),
        "folder": api_a.post("/api/datasets/import/", {"name": "sums-folder", "path": "sums", "split": "train",
                                                       **mapping}, format="json"),
    }
    for kind, response in versions.items():
        assert response.status_code == 201, (kind, response.content)
    return {kind: response.json() for kind, response in versions.items()}


@pytest.mark.django_db
def test_parquet_and_folder_versions_hold_exactly_the_rows_of_the_same_jsonl(three_versions, api_a):
    shas = {kind: body["sha256"] for kind, body in three_versions.items()}
    assert shas["parquet"] == shas["jsonl"] == shas["folder"], shas
    preview = api_a.get(f"/api/datasets/{three_versions['folder']['dataset']}/versions/1/preview/",
                        {"limit": 48}).json()["rows"]
    assert [{**r, "answer": str(r["answer"])} for r in ROWS] == preview


@pytest.mark.engine
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["parquet", pytest.param("folder", marks=pytest.mark.slow)])
def test_a_run_on_a_parquet_or_folder_version_trains(three_versions, team_a, alice, tmp_path, monkeypatch, kind):
    from workers.tasks import prompts

    monkeypatch.setattr(prompts, "_template_checker", None)  # the engine compiles its templates itself
    body = three_versions[kind]
    run = submit_run(team_a, alice, run_spec(body["ref"]))
    assert run.dataset_version.sha256 == body["sha256"]
    spec = validate_spec(resolve_spec(run))
    assert spec.task.dataset == str(run.dataset_version.path)
    result = asyncio.run(Controller(spec, tmp_path / "out", progress=False).run())
    assert result.steps == 2 and result.trained_samples == 2 * 4 * 4
    points = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert {p["step"] for p in points if p["key"] == "reward/mean"} >= {1, 2}
