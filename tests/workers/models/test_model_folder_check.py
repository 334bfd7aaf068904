"""The load-time check every loader runs before transformers or vLLM opens a model folder
(workers/tasks/model_folder.py): a folder whose shard index, config or
links reach outside it is refused before any weight is read, whoever stored it and
whenever; a clean folder (and a Hugging Face cache snapshot) loads as before."""
import asyncio
import json
import os
import shutil

import pytest
import torch
import transformers
from safetensors import safe_open

from tests.platform.model_archives import POLICY, RM
from workers.cluster.model_size import model_size
from workers.models.preflight import ModelCheckError
from workers.models.reward_model import resolve_reward_model_path
from workers.rewards.model import Scorer
from workers.rollout.engine import RolloutEngine
from workers.tasks.model_folder import UnsafeModelFolder, check_model_folder
from workers.tasks.prompts import PromptError, load_tokenizer
from workers.train.pipeline import load_model
from workers.train.reference import ReferenceScorer


def copy_model(source, to):
    to.mkdir(parents=True)
    for f in source.iterdir():
        if f.name != "fluxrl_bootstrap.json":
            shutil.copy(f, to / f.name)
    return to


def tensor_names(folder) -> list[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return list(f.keys())


@pytest.fixture
def victim(tmp_path):
    """Another team's trained model, next to the attacker's folder."""
    return copy_model(POLICY, tmp_path / "runs" / "1" / "out" / "final_model")


def planted(tmp_path, victim, index_name="model.safetensors.index.json", source=POLICY, **config):
    """The attacker's folder: config and tokenizer of its own, no weights, an index naming the victim's."""
    folder = copy_model(source, tmp_path / "team-models" / "2" / "7" / "v1")
    os.remove(folder / "model.safetensors")
    relative = os.path.relpath(victim / "model.safetensors", folder)
    (folder / index_name).write_text(json.dumps({"metadata": {}, "weight_map": {
        name: relative for name in tensor_names(victim)}}))
    if config:
        (folder / "config.json").write_text(json.dumps(json.loads((folder / "config.json").read_text()) | config))
    return folder


@pytest.fixture
def loads(monkeypatch):
    """The paths transformers' from_pretrained was called on."""
    seen = []
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoModel,
                transformers.AutoModelForSequenceClassification, transformers.AutoTokenizer):
        real = cls.from_pretrained
        monkeypatch.setattr(cls, "from_pretrained",
                            lambda path, *a, _real=real, **k: seen.append(str(path)) or _real(path, *a, **k))
    return seen


def test_a_planted_index_really_loads_the_victims_weights_without_the_check(tmp_path, victim):
    folder = planted(tmp_path, victim)
    stolen = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).state_dict()
    with safe_open(str(victim / "model.safetensors"), "pt") as f:
        name = tensor_names(victim)[0]
        assert torch.equal(stolen[name], f.get_tensor(name))  # why every loader runs the check


def test_every_loader_refuses_a_folder_whose_index_points_outside_it_before_any_weight_loads(tmp_path, victim, loads):
    folder = str(planted(tmp_path, victim))
    with pytest.raises(UnsafeModelFolder, match=r"model\.safetensors\.index\.json: shard '\.\./.*runs/1/out/"
                                                r"final_model/model\.safetensors' is outside the model folder"):
        check_model_folder(folder)
    with pytest.raises(UnsafeModelFolder):  # the reference stage (the trainer, critic, value stage load alike)
        ReferenceScorer(folder, "float32", 0, 1.0, 0, 1.0, pad_id=0)
    with pytest.raises(UnsafeModelFolder):  # the pipeline's actor
        load_model(folder, "actor")
    with pytest.raises(UnsafeModelFolder):  # the GPU memory plan reads the config
        model_size(folder)
    with pytest.raises(UnsafeModelFolder):  # vLLM: refused before the engine (or vLLM) starts
        asyncio.run(RolloutEngine(folder).start())
    with pytest.raises(PromptError, match="is outside the model folder"):  # the preflight's tokenizer
        load_tokenizer(folder)
    assert loads == []  # transformers never opened the folder


def test_a_clean_folder_loads_through_the_same_loaders(tmp_path, loads):
    folder = str(copy_model(POLICY, tmp_path / "clean"))
    assert check_model_folder(folder) == folder
    ReferenceScorer(folder, "float32", 0, 1.0, 0, 1.0, pad_id=0)
    assert load_model(folder, "actor") is not None
    assert model_size(folder).params > 0
    assert loads == [folder, folder]


def test_a_config_with_auto_map_but_no_redirect_loads_without_remote_code(tmp_path, loads):
    """auto_map is refused at upload; at load it runs nothing (no trust_remote_code), and
    cached hub models carry it, so the load-time check lets it through."""
    folder = copy_model(POLICY, tmp_path / "auto-map")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling.M"}
    (folder / "config.json").write_text(json.dumps(config))
    assert check_model_folder(str(folder)) == str(folder)
    assert load_model(str(folder), "actor") is not None


@pytest.mark.parametrize("index_name, config, message", [
    ("pytorch_model.bin.index.json", {}, "pytorch_model.bin.index.json: shard '../"),
    ("other.safetensors.index.json", {"transformers_weights": "other.safetensors.index.json"},
     "config.json: 'transformers_weights' is refused"),
])
def test_each_redirect_is_refused_naming_its_file(tmp_path, victim, loads, index_name, config, message):
    folder = str(planted(tmp_path, victim, index_name, **config))
    with pytest.raises(UnsafeModelFolder, match=message.replace(".", r"\.")):
        ReferenceScorer(folder, "float32", 0, 1.0, 0, 1.0, pad_id=0)
    assert loads == []


def test_a_shard_linked_outside_the_folder_is_refused(tmp_path, victim):
    folder = copy_model(POLICY, tmp_path / "linked")
    os.remove(folder / "model.safetensors")
    os.symlink(victim / "model.safetensors", folder / "model.safetensors")  # vLLM globs *.safetensors
    with pytest.raises(UnsafeModelFolder, match="model.safetensors: links outside the model folder"):
        asyncio.run(RolloutEngine(str(folder)).start())


def test_a_reward_model_folder_is_checked_when_resolved_and_when_loaded(tmp_path):
    victim = copy_model(RM, tmp_path / "victim-rm")
    folder = planted(tmp_path, victim, source=RM)
    with pytest.raises(ModelCheckError, match="reward.model.path: .* is outside the model folder"):
        resolve_reward_model_path(str(folder))
    with pytest.raises(UnsafeModelFolder):
        Scorer(str(folder))


def test_a_hugging_face_cache_snapshot_links_into_its_blobs_and_loads(tmp_path):
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for f in POLICY.iterdir():
        shutil.copy(f, repo / "blobs" / f"blob-{f.name}")
        os.symlink(f"../../blobs/blob-{f.name}", snapshot / f.name)
    assert check_model_folder(str(snapshot)) == str(snapshot)
    ReferenceScorer(str(snapshot), "float32", 0, 1.0, 0, 1.0, pad_id=0)
