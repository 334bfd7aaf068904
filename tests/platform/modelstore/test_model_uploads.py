"""Model folders a team uploads (POST /api/models/): stored like datasets, immutable and
checksummed, named in a run spec as model:<name>[@<version>] (model.path for a causal LM,
reward.model.path for a classifier), pinned at submission, invisible to other teams; an
archive that is not a plain safetensors folder is refused by name and leaves nothing."""
import hashlib
import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from fluxrl.modelstore.models import StoredModel, StoredModelVersion
from fluxrl.runs.models import Run
from fluxrl.runs.engine_inputs import resolve_spec
from tests.platform.model_archives import POLICY, RM, folder_files, tar_gz, zipped

def upload(client, body: bytes, file_name="rm.tar.gz", name="rm"):
    return client.post("/api/models/", {"file": SimpleUploadedFile(file_name, body), "name": name}, format="multipart")


def reward_model_spec(spec, path):
    return spec(reward={"components": [{"function": "model"}, {"function": "numeric_match", "weight": 0}],
                        "model": {"path": path}})


def test_a_reward_model_folder_is_stored_immutable_checksummed_and_flattened(api_a, data_dir):
    files = folder_files(RM)
    response = upload(api_a, tar_gz(files, top="tiny-rm/"))  # one top-level folder: dropped
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["ref"], body["kind"], body["architecture"]) == ("model:rm@1", "sequence-classification",
                                                                 "Qwen2ForSequenceClassification")
    assert [f[0] for f in body["files"]] == sorted(files)
    version = StoredModelVersion.objects.get(model_id=body["model"], version=1)
    assert version.path.is_relative_to(data_dir / "team-models")  # not under a model root any team may name
    for name, content in files.items():
        stored = version.path / name
        assert stored.read_bytes() == content and oct(stored.stat().st_mode & 0o777) == "0o444"
    assert [f for f in body["files"] if f[0] == "model.safetensors"][0][2] == \
        hashlib.sha256(files["model.safetensors"]).hexdigest()
    # the same files in a zip (no top folder): a new version with the same checksum
    again = upload(api_a, zipped(files), "rm.zip").json()
    assert (again["version"], again["sha256"]) == (2, body["sha256"])
    listed = api_a.get("/api/models/").json()["results"]
    assert [(m["name"], m["version_count"], m["latest"]["version"]) for m in listed] == [("rm", 2, 2)]


@pytest.mark.parametrize("files, links, message", [
    ({"../config.json": b"{}"}, None, "'../config.json': a file name must be relative"),
    ({"/etc/config.json": b"{}"}, None, "a file name must be relative"),
    ({".hidden/x.json": b"{}"}, None, "no part starting with '.'"),
    ({"config.json": b"{}"}, {"model.safetensors": "/etc/shadow"}, "model.safetensors: not a regular file"),
    ({"config.json": b"{}", "pytorch_model.bin": b"\x80\x04"}, None,
     "pytorch_model.bin: pickled weights run code when they are loaded"),
    ({"config.json": b"{}", "modeling_x.py": b"import os"}, None, "custom model code is not run"),
    ({"config.json": b"{}", "run.sh": b"rm -rf /"}, None, "run.sh: not a file a model folder needs"),
    ({"tokenizer.json": b"{}", "model.safetensors": b"x"}, None, "no config.json at its top level"),
    ({"config.json": b"not json", "model.safetensors": b"x"}, None, "config.json is not JSON"),
    ({"config.json": json.dumps({"architectures": ["BertModel"]}).encode(), "model.safetensors": b"x"}, None,
     "BertModel is neither a causal LM"),
    ({"config.json": json.dumps({"architectures": ["LlamaForCausalLM"]}).encode()}, None,
     "the archive has no .safetensors weights"),
])
def test_an_archive_that_is_not_a_plain_safetensors_folder_is_refused_by_name_and_leaves_nothing(
        api_a, data_dir, files, links, message):
    response = upload(api_a, tar_gz(files, links=links))
    assert response.status_code == 400, response.content
    assert message in response.json()["error"]["message"] and "file" in response.json()["error"]["fields"]
    assert not StoredModel.objects.exists()
    assert not list((data_dir / "team-models").rglob("*"))  # the staging folder went too


def test_too_many_files_are_refused_before_the_archive_is_read_to_its_end(api_a):
    files = {f"x{i}.txt": b"" for i in range(300)}
    message = upload(api_a, tar_gz(files)).json()["error"]["message"]
    assert message == "file: the archive holds more than 256 files"
    assert upload(api_a, zipped(files), "m.zip").json()["error"]["message"] == message


def test_not_an_archive_and_too_large_are_refused(api_a, settings):
    assert "upload the model folder as a .tar" in upload(api_a, b"{}", "config.json").json()["error"]["message"]
    assert "rm.tar.gz is not a gzip-compressed tar archive, as its name says" in \
        upload(api_a, b"plain bytes").json()["error"]["message"]
    settings.FLUXRL_MAX_MODEL_BYTES = 2_500_000  # the archive (2.45 MB) fits; its files (2.64 MB) do not
    response = upload(api_a, tar_gz(folder_files(RM)))
    assert response.status_code == 413 and "FLUXRL_MAX_MODEL_MB" in response.json()["error"]["message"]
    assert not StoredModel.objects.exists()


def test_a_run_names_its_teams_models_pinned_at_submission_and_no_other_team_can(api_a, api_b, spec, team_a):
    assert upload(api_a, tar_gz(folder_files(RM))).status_code == 201
    assert upload(api_a, tar_gz(folder_files(POLICY)), name="policy").status_code == 201
    submitted = api_a.post("/api/runs/", {"spec": reward_model_spec(
        lambda **s: spec(model={"path": "model:policy"}, **s), "model:rm")})
    assert submitted.status_code == 201, submitted.content
    run = Run.objects.get(pk=submitted.json()["id"])
    assert (str(run.model_version), str(run.reward_model_version)) == ("policy@1", "rm@1")
    # a newer upload does not change a submitted run: the engine gets the pinned folders
    assert upload(api_a, zipped(folder_files(RM)), "rm.zip").json()["version"] == 2
    resolved = resolve_spec(run)
    assert resolved["model"]["path"] == str(run.model_version.path)
    assert resolved["reward"]["model"]["path"] == str(run.reward_model_version.path)
    # the kinds are checked: a classifier is no policy, a causal LM no reward model
    wrong = api_a.post("/api/runs/", {"spec": spec(model={"path": "model:rm"})}).json()["error"]
    assert "model:rm is a Qwen2ForSequenceClassification (sequence-classification); model.path needs a causal-lm " \
           "model" in wrong["message"] and "spec.model.path" in wrong["fields"]
    wrong = api_a.post("/api/runs/", {"spec": reward_model_spec(spec, "model:policy")}).json()["error"]
    assert "spec.reward.model.path" in wrong["fields"]
    # another team sees no model of team A, and cannot name one
    assert api_b.get("/api/models/").json()["results"] == []
    assert api_b.get(f"/api/models/{run.model_version.model_id}/").status_code == 404
    other = api_b.post("/api/runs/", {"spec": reward_model_spec(spec, "model:rm")})
    assert other.status_code == 400 and "spec.reward.model.path" in other.json()["error"]["fields"]
    # nor reach the stored folder by its path: it is under no model root
    by_path = api_b.post("/api/runs/", {"spec": spec(model={"path": str(run.model_version.path)})})
    assert by_path.status_code == 400 and "spec.model.path" in by_path.json()["error"]["fields"]


# --- the folder as a loader reads it ---------------------------------------------------

VICTIM = "../../../../runs/1/out/final_model/model.safetensors"  # another team's run, relative to the stored folder


def redirected(changes: dict[str, bytes | None], base=RM) -> dict[str, bytes]:
    """The tiny model's files with ``changes`` (None: left out): its weights under another name
    unless a change keeps them."""
    files = folder_files(base)
    files["weights.safetensors"] = files.pop("model.safetensors")
    files.update(changes)
    return {name: body for name, body in files.items() if body is not None}


def weight_map(*shards: str) -> bytes:
    return json.dumps({"metadata": {}, "weight_map": {f"t{i}": s for i, s in enumerate(shards)}}).encode()


def with_config(base=RM, **extra) -> bytes:
    return json.dumps(json.loads((base / "config.json").read_bytes()) | extra).encode()


@pytest.mark.parametrize("changes, message", [
    # transformers reads a pytorch_model.bin.index.json when there is no model.safetensors
    ({"pytorch_model.bin.index.json": weight_map(VICTIM)}, "pytorch_model.bin.index.json: the only shard index read "
                                                           "is a top-level model.safetensors.index.json"),
    ({"sharded.safetensors.index.json": weight_map(VICTIM),
      "config.json": with_config(transformers_weights="sharded.safetensors.index.json")},
     "sharded.safetensors.index.json: the only shard index read"),
    ({"config.json": with_config(transformers_weights="weights.safetensors")},
     "config.json: 'transformers_weights' is refused"),
    ({"model.safetensors.index.json": weight_map("weights.safetensors", VICTIM)},
     f"model.safetensors.index.json names shards outside the folder: '{VICTIM}'"),
    ({"model.safetensors.index.json": weight_map("/srv/fluxrl/runs/1/out/final_model/model.safetensors")},
     "model.safetensors.index.json names shards outside the folder"),
    ({"model.safetensors.index.json": weight_map("sub/weights.safetensors")},
     "model.safetensors.index.json names shards outside the folder"),
    ({"model.safetensors.index.json": weight_map("weights.safetensors", "model-00002.safetensors")},
     "model.safetensors.index.json names shards the archive lacks: model-00002.safetensors"),
    ({"model.safetensors.index.json": b'{"weight_map": ["weights.safetensors"]}'},
     "model.safetensors.index.json has no weight_map"),
    ({"sub/model.safetensors.index.json": weight_map(VICTIM)}, "sub/model.safetensors.index.json: the only shard index"),
    ({"config.json": with_config(auto_map={"AutoModel": "modeling.Model"})}, "config.json: 'auto_map' is refused"),
    ({"config.json": with_config(text_config={"auto_map": {"AutoModel": "x.Y"}})}, "config.json: 'auto_map' is refused"),
    ({"tokenizer_config.json": json.dumps({"auto_map": {"AutoTokenizer": ["tok.T", None]}}).encode()},
     "tokenizer_config.json: 'auto_map' is refused"),
    ({"generation_config.json": json.dumps({"trust_remote_code": True}).encode()},
     "generation_config.json: 'trust_remote_code' is refused"),
    ({"adapter_config.json": json.dumps({"base_model_name_or_path": "../../../../runs/1/out/final_model"}).encode()},
     "adapter_config.json: a PEFT adapter loads its base model"),
])
def test_an_archive_a_loader_would_read_other_weights_or_code_from_is_refused_by_name_and_leaves_nothing(
        api_a, data_dir, changes, message):
    response = upload(api_a, tar_gz(redirected(changes)))
    assert response.status_code == 400, response.content
    assert message in response.json()["error"]["message"] and "file" in response.json()["error"]["fields"]
    assert not StoredModel.objects.exists()
    assert not list((data_dir / "team-models").rglob("*"))


def test_a_sharded_folder_whose_index_names_its_own_shards_is_stored(api_a):
    files = redirected({"model.safetensors.index.json": weight_map("weights.safetensors", "weights.safetensors")})
    response = upload(api_a, zipped(files, top="rm/"), "rm.zip")
    assert response.status_code == 201, response.content
    assert "model.safetensors.index.json" in [f[0] for f in response.json()["files"]]
