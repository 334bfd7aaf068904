"""A run's weights downloaded as a Hugging Face folder (runs/exports.py, GET
/api/runs/<id>/exports/ and /model/): the real engine's outputs (one CLI run on the tiny
model, checkpoints every 2 steps, copied into each test run's output folder as the
dispatcher's --out would leave them), unpacked and loaded with transformers."""
import asyncio
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tracemalloc
import zipfile
from pathlib import Path

import pytest
import yaml

from fluxrl.accounts import services as accounts
from fluxrl.runs.engine_inputs import run_output_dir
from fluxrl.runs.models import RunStatus
from fluxrl.runs.services import submit_run, transition
from tests.platform.conftest import make_spec

SPEC = {
    "name": "export-me",
    "model": {"path": "builtin:tiny"},
    "task": {"dataset": "gen:add?max_digits=2", "size": 64, "eval_size": 8},
    "reward": {"function": "numeric_match"},
    "algorithm": {"loss": "ppo", "group_size": 4, "lr": 1.0e-3},
    "rollout": {"max_tokens": 8, "update_mode": "keep"},
    "schedule": {"mode": "sync", "batch_prompts": 4},
    "trainer": {"checkpoint_every": 2},
    "stop": {"max_steps": 4, "max_minutes": 5},
    "eval": {"every_steps": 0, "prompts": 8},
}


@pytest.fixture(scope="session")
def engine_outputs(tmp_path_factory, tiny_model_path):
    """What `python -m workers run` leaves in --out: final_model, checkpoints step-2 and step-4, result.json."""
    folder = tmp_path_factory.mktemp("engine")
    (folder / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    proc = subprocess.run([sys.executable, "-m", "workers", "run", str(folder / "spec.yaml"), "--out",
                           str(folder / "out"), "--no-progress"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder / "out"


def ended(run, outputs: Path | None, status=RunStatus.SUCCEEDED):
    """The run as its dispatcher leaves it: the engine's outputs in run_output_dir, the run ended."""
    if outputs is not None:
        shutil.copytree(outputs, run_output_dir(run.pk))
    transition(run, RunStatus.STARTING)
    transition(run, RunStatus.RUNNING)
    if status != RunStatus.RUNNING:
        transition(run, status)
    return run


def content(response) -> bytes:
    assert response.status_code == 200, response.content
    return b"".join(response.streaming_content)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_a_downloaded_final_model_loads_with_from_pretrained_and_computes_what_the_runs_final_model_does(
        api_a, run_a, engine_outputs, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ended(run_a, engine_outputs)
    listed = api_a.get(f"/api/runs/{run_a.pk}/exports/")
    assert listed.status_code == 200, listed.content
    assert [(e["checkpoint"], e["step"]) for e in listed.json()] == [("final", 4), ("4", 4), ("2", 2)]
    final = listed.json()[0]
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {f["name"] for f in final["files"]}

    response = api_a.get(final["download"])
    assert response["Content-Disposition"] == f'attachment; filename="run-{run_a.pk}-final.tar.gz"'
    with tarfile.open(fileobj=io.BytesIO(content(response)), mode="r:gz") as archive:
        archive.extractall(tmp_path, filter="data")
    folder = tmp_path / f"run-{run_a.pk}-final"
    source = engine_outputs / "final_model"
    assert sorted(p.name for p in folder.iterdir()) == sorted(f["name"] for f in final["files"])
    assert all(sha(folder / p.name) == sha(source / p.name) for p in folder.iterdir())

    torch.manual_seed(0)
    downloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("12+34=", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(downloaded(ids).logits, original(ids).logits)
        generated = downloaded.generate(ids, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] == ids.shape[1] + 3
    assert tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True) is not None

    # A checkpoint's weights, as a zip: the step-2 model, not the final one.
    step_2 = api_a.get(f"/api/runs/{run_a.pk}/model/?checkpoint=2&archive=zip")
    with zipfile.ZipFile(io.BytesIO(content(step_2))) as archive:
        archive.extractall(tmp_path)
    early = tmp_path / f"run-{run_a.pk}-step-2"
    assert sha(early / "model.safetensors") == sha(engine_outputs / "checkpoints/step-2/model/model.safetensors")
    assert sha(early / "model.safetensors") != sha(folder / "model.safetensors")  # four steps at lr 1e-3 moved it
    assert AutoModelForCausalLM.from_pretrained(early).config.architectures == ["Qwen2ForCausalLM"]


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_a_run_saved_as_a_team_model_is_a_model_a_new_run_starts_from(api_a, run_a, alice, team_a, engine_outputs):
    ended(run_a, engine_outputs)
    saved = api_a.post(f"/api/runs/{run_a.pk}/model/save/", {"name": "from-run", "checkpoint": "4"}, archive="json")
    assert saved.status_code == 201, saved.content
    assert saved.json()["ref"] == "model:from-run@1" and saved.json()["kind"] == "causal-lm"
    stored = {name: digest for name, _, digest in saved.json()["files"]}
    assert stored["model.safetensors"] == sha(engine_outputs / "checkpoints/step-4/model/model.safetensors")
    run = submit_run(team_a, alice, make_spec(model={"path": "model:from-run"}))
    assert run.model_version.model.name == "from-run"


def test_another_team_gets_the_answer_of_a_missing_run(api_a, api_b, run_a, assert_error):
    ended(run_a, None)
    missing = run_a.pk + 1000
    for path in ("exports/", "model/", "model/?checkpoint=final&archive=zip"):
        theirs = api_b.get(f"/api/runs/{run_a.pk}/{path}")
        nothing = api_b.get(f"/api/runs/{missing}/{path}")
        assert theirs.status_code == nothing.status_code == 404
        assert theirs.json() == {**nothing.json()}
    saved = api_b.post(f"/api/runs/{run_a.pk}/model/save/", {"name": "stolen"}, archive="json")
    assert_error(saved, 404)


def test_run_tokens_and_tokens_without_the_read_scope_cannot_download(run_a, alice, client_for, worker_client,
                                                                         assert_error):
    ended(run_a, None, RunStatus.RUNNING)
    run_token = worker_client(run_a)
    assert_error(run_token.get(f"/api/runs/{run_a.pk}/model/"), 403)
    assert_error(run_token.get(f"/api/runs/{run_a.pk}/exports/"), 403)
    assert_error(client_for(alice, scopes=["write"]).get(f"/api/runs/{run_a.pk}/exports/"), 403)


def model_folder(folder: Path, marker: str = "x") -> Path:
    """A small Hugging Face folder, as the trainer's save_pretrained writes one."""
    from safetensors.torch import save_file
    import torch

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "note": marker}))
    save_file({"w": torch.arange(6, dtype=torch.float32)}, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text("{}")
    return folder


def checkpoint(out: Path, step: int) -> Path:
    folder = out / "checkpoints" / f"step-{step}"
    model_folder(folder / "model")
    (folder / "meta.json").write_text(json.dumps({"version": step, "step": step}))
    return folder


def test_a_run_without_weights_says_what_it_has(api_a, run_a, assert_error):
    assert api_a.get(f"/api/runs/{run_a.pk}/exports/").json() == []
    body = assert_error(api_a.get(f"/api/runs/{run_a.pk}/model/"), 409, "not_finished", "checkpoint")
    assert f"Run {run_a.pk} is queued: its final model is saved when it ends" in body["message"]
    assert "Exportable now: none" in body["message"]

    ended(run_a, None, RunStatus.RUNNING)
    checkpoint(run_output_dir(run_a.pk), 3)
    assert [e["checkpoint"] for e in api_a.get(f"/api/runs/{run_a.pk}/exports/").json()] == ["3"]
    body = assert_error(api_a.get(f"/api/runs/{run_a.pk}/model/"), 409, "not_finished", "checkpoint")
    assert "Exportable now: 3" in body["message"]
    body = assert_error(api_a.get(f"/api/runs/{run_a.pk}/model/?checkpoint=2"), 404, "not_found", "checkpoint")
    assert "no checkpoint at step 2" in body["message"] and "Exportable: 3." in body["message"]
    assert_error(api_a.get(f"/api/runs/{run_a.pk}/model/?checkpoint=../final_model"), 400, field="checkpoint")
    assert_error(api_a.get(f"/api/runs/{run_a.pk}/model/?checkpoint=3&archive=rar"), 400, field="archive")
    assert api_a.get(f"/api/runs/{run_a.pk}/model/?checkpoint=3").status_code == 200

    transition(run_a, RunStatus.FAILED, failure_reason="boom")  # failed before its final model
    body = assert_error(api_a.get(f"/api/runs/{run_a.pk}/model/?checkpoint=final"), 404, "not_found", "checkpoint")
    assert "failed without saving a final model. Exportable: 3." in body["message"]


def test_the_archive_holds_the_folders_own_regular_files_and_nothing_it_links_to(api_a, run_a, run_b, tmp_path):
    ended(run_a, None)
    out = run_output_dir(run_a.pk)
    final = model_folder(out / "final_model")
    (out / "result.json").write_text(json.dumps({"steps": 7}))
    secret = model_folder(run_output_dir(run_b.pk) / "final_model", marker="team-b-secret")
    os.symlink(secret / "config.json", final / "special_tokens_map.json")  # a link to another team's file
    os.symlink(secret, final / "linked")
    (final / "optimizer.pt").write_bytes(b"pickle")  # pickles and code are not a model folder's files
    (final / "modeling.py").write_text("import os")
    (final / ".hidden.json").write_text("{}")

    listed = api_a.get(f"/api/runs/{run_a.pk}/exports/").json()
    assert [(e["checkpoint"], e["step"]) for e in listed] == [("final", 7)]
    names = ["config.json", "model.safetensors", "tokenizer.json"]
    assert [f["name"] for f in listed[0]["files"]] == names
    response = api_a.get(f"/api/runs/{run_a.pk}/model/?archive=tar")
    raw = content(response)
    assert int(response["Content-Length"]) == len(raw)
    with tarfile.open(fileobj=io.BytesIO(raw)) as archive:
        members = archive.getmembers()
    assert [m.name for m in members] == [f"run-{run_a.pk}-final/{n}" for n in names]
    assert all(m.isreg() for m in members) and b"team-b-secret" not in raw

    # final_model itself a link to another team's folder: nothing to export
    shutil.rmtree(final)
    os.symlink(secret, final)
    assert api_a.get(f"/api/runs/{run_a.pk}/exports/").json() == []
    assert api_a.get(f"/api/runs/{run_a.pk}/model/").status_code == 404


def big_run(run, size_mb: int) -> Path:
    ended(run, None)
    final = model_folder(run_output_dir(run.pk) / "final_model")
    with open(final / "model-00002-of-00002.safetensors", "wb") as fh:  # bytes on disk, never parsed
        for _ in range(size_mb):
            fh.write(os.urandom(1 << 20))
    (run_output_dir(run.pk) / "result.json").write_text(json.dumps({"steps": 1}))
    return final


@pytest.mark.parametrize("fmt", ["tar.gz", "zip"])
def test_a_download_streams_in_bounded_memory(api_a, run_a, fmt):
    final = big_run(run_a, 48)
    response = api_a.get(f"/api/runs/{run_a.pk}/model/?archive={fmt}")
    assert response.status_code == 200 and response.streaming
    tracemalloc.start()
    try:
        total = sum(len(chunk) for chunk in response.streaming_content)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert total > 48 << 20  # random bytes do not compress
    assert peak < 12 << 20, f"{peak / 2**20:.1f} MiB held while streaming {total / 2**20:.0f} MiB"
    assert final.exists()


@pytest.mark.django_db(transaction=True)
def test_under_asgi_the_download_is_sent_chunk_by_chunk(team_a, alice, settings):
    """Served by the ASGI handler (daphne): the chunks go out as they are made, not after
    Django has read a sync iterator into a list."""
    from asgiref.sync import sync_to_async
    from django.db import connections
    from django.test import AsyncClient

    run = submit_run(team_a, alice, make_spec())
    big_run(run, 24)
    key = accounts.create_api_token(alice, "asgi")[1]

    async def download():
        response = await AsyncClient().get(f"/api/runs/{run.pk}/model/?archive=tar",
                                           headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200
        tracemalloc.start()
        total, chunks = 0, 0
        async for chunk in response:  # as django.core.handlers.asgi sends it
            total, chunks = total + len(chunk), chunks + 1
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        await sync_to_async(connections.close_all)()  # the view's thread's connection, before the test database goes
        return int(response["Content-Length"]), total, chunks, peak

    length, total, chunks, peak = asyncio.run(download())
    assert total == length > 24 << 20 and chunks > 20
    assert peak < 12 << 20, f"{peak / 2**20:.1f} MiB held"


def test_the_run_page_links_each_export_and_the_link_downloads_with_the_session(client, alice, run_a):
    ended(run_a, None, RunStatus.RUNNING)
    client.force_login(alice)
    page = client.get(f"/runs/{run_a.pk}/").content.decode()
    assert "none yet: the final model when the run ends" in page
    out = run_output_dir(run_a.pk)
    checkpoint(out, 2)
    checkpoint(out, 4)
    transition(run_a, RunStatus.SUCCEEDED)
    model_folder(out / "final_model")
    (out / "result.json").write_text(json.dumps({"steps": 5}))
    page = client.get(f"/runs/{run_a.pk}/").content.decode()
    links = [f'href="/api/runs/{run_a.pk}/model/?checkpoint={c}" download data-checkpoint="{c}"'
             for c in ("final", "4", "2")]
    assert all(link in page for link in links) and page.index(links[0]) < page.index(links[1]) < page.index(links[2])
    download = client.get(f"/api/runs/{run_a.pk}/model/?checkpoint=4")
    with tarfile.open(fileobj=io.BytesIO(content(download)), mode="r:gz") as archive:
        assert archive.getnames() == [f"run-{run_a.pk}-step-4/{n}" for n in ("config.json", "model.safetensors",
                                                                             "tokenizer.json")]


def test_weights_larger_than_a_team_model_may_be_are_refused_before_a_copy_is_made(api_a, run_a, settings,
                                                                                   assert_error):
    big_run(run_a, 2)
    settings.FLUXRL_MAX_MODEL_BYTES = 1 << 20
    body = assert_error(api_a.post(f"/api/runs/{run_a.pk}/model/save/", {"name": "huge"}, format="json"), 413,
                        "too_large", "checkpoint")
    assert "FLUXRL_MAX_MODEL_MB" in body["message"]
    assert not list((settings.FLUXRL_DATA_DIR / "team-models").glob("**/*.tar"))


@pytest.fixture(scope="session")
def lora_outputs(tmp_path_factory, tiny_model_path):
    """A LoRA run's --out (model.lora): final_model is the merged model, final_model/adapter the PEFT folder."""
    folder = tmp_path_factory.mktemp("engine-lora")
    spec = {**SPEC, "name": "export-lora", "model": {"path": "builtin:tiny", "lora": {"rank": 4, "alpha": 8}},
            "algorithm": {**SPEC["algorithm"], "lr": 1.0e-2}}
    (folder / "spec.yaml").write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "workers", "run", str(folder / "spec.yaml"), "--out",
                           str(folder / "out"), "--no-progress"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder / "out"


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_a_lora_runs_adapter_downloads_as_a_peft_folder_that_on_the_base_model_computes_the_merged_model(
        api_a, run_a, lora_outputs, tiny_model_path, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ended(run_a, lora_outputs)
    final = api_a.get(f"/api/runs/{run_a.pk}/exports/").json()[0]
    assert final["checkpoint"] == "final" and final["adapter_download"].endswith("&part=adapter")
    assert 0 < final["adapter_bytes"] < 0.05 * final["size_bytes"]  # the adapter is a small part of the model

    response = api_a.get(final["adapter_download"])
    assert response["Content-Disposition"] == f'attachment; filename="run-{run_a.pk}-final-adapter.tar.gz"'
    with tarfile.open(fileobj=io.BytesIO(content(response)), mode="r:gz") as archive:
        archive.extractall(tmp_path, filter="data")
    adapter = tmp_path / f"run-{run_a.pk}-final-adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    # the worker's folder of the base model stays on the server: the user names the base when loading
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] is None

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(tiny_model_path)("12+34=", return_tensors="pt").input_ids
    with torch.no_grad():
        before = base(ids).logits
        with_adapter = PeftModel.from_pretrained(base, adapter).eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(lora_outputs / "final_model", dtype=torch.float32).eval()(ids).logits
    assert not torch.allclose(with_adapter, before)  # the adapter trained (B no longer 0)
    assert torch.allclose(with_adapter, merged, atol=1e-4)  # the whole-model download is the same policy


def test_a_run_without_an_adapter_says_so_and_a_bad_part_names_the_field(api_a, run_a, assert_error):
    ended(run_a, None)
    out = run_output_dir(run_a.pk)
    model_folder(out / "final_model")
    (out / "result.json").write_text(json.dumps({"steps": 2}))
    assert api_a.get(f"/api/runs/{run_a.pk}/exports/").json()[0]["adapter_download"] is None
    body = assert_error(api_a.get(f"/api/runs/{run_a.pk}/model/?part=adapter"), 404, "not_found", "part")
    assert "has no LoRA adapter" in body["message"]
    assert_error(api_a.get(f"/api/runs/{run_a.pk}/model/?part=optimizer"), 400, field="part")
    assert api_a.get(f"/api/runs/{run_a.pk}/model/?part=model").status_code == 200


def test_an_archive_never_read_closes_its_files_when_the_response_is_closed(api_a, run_a):
    """A client gone before the first chunk: the response's close releases every opened file."""
    ended(run_a, None)
    out = run_output_dir(run_a.pk)
    model_folder(out / "final_model")
    (out / "result.json").write_text(json.dumps({"steps": 2}))
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        response = api_a.get(f"/api/runs/{run_a.pk}/model/")
        assert response.status_code == 200
        for closer in response._resource_closers:  # what response.close() runs when the client has gone
            closer()  # (close() itself would also end the test's database connection: request_finished)
    assert len(os.listdir("/proc/self/fd")) <= before
