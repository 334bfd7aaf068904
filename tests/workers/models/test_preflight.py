"""A run's model and data are checked before any process starts, with errors that say what to do."""
import json
import shutil
from pathlib import Path

import pytest

from workers.models.preflight import ModelCheckError, check_run, resolve_model_path
from workers.spec import validate_spec


def _spec(path, **rollout):
    return validate_spec({"name": "t", "model": {"path": path}, "task": {"dataset": "gen:add"},
                          "rollout": {"max_tokens": 8, **rollout}})


def _rows(*prompts):
    return [{"prompt": p, "answer": "1"} for p in prompts]


@pytest.fixture()
def model_copy(tiny_model_path, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    return folder


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_the_tiny_model_passes_with_its_own_stop_id_and_a_tight_length(tiny_model_path):
    checked = check_run(_spec(tiny_model_path), _rows("12+7=", "1+1="), _rows("3+4="))
    assert checked.stop_ids == [2]
    assert checked.pad_id == 0
    assert checked.max_model_len == 5 + 8  # the longest prompt's tokens + max_tokens
    assert checked.skipped == {"train": 0, "eval": 0}


def test_prompts_too_long_for_max_model_len_are_skipped_and_counted(tiny_model_path):
    checked = check_run(_spec(tiny_model_path, max_model_len=20), _rows("1+1=", "1" * 13, "1" * 12), _rows("2" * 20))
    assert [r["prompt"] for r in checked.train_rows] == ["1+1=", "1" * 12]
    assert checked.skipped == {"train": 1, "eval": 1}
    assert checked.max_model_len == 20


def test_a_run_whose_every_prompt_is_too_long_is_refused(tiny_model_path):
    with pytest.raises(ModelCheckError, match="every training prompt is too long"):
        check_run(_spec(tiny_model_path, max_model_len=16), _rows("1" * 9), [])


def test_max_model_len_beyond_the_models_positions_is_refused(tiny_model_path):
    with pytest.raises(ModelCheckError, match="max_model_len 1000 exceeds the model's 256 positions"):
        check_run(_spec(tiny_model_path, max_model_len=1000), _rows("1+1="), [])


def test_max_tokens_that_leave_no_room_for_a_prompt_are_refused(tiny_model_path):
    with pytest.raises(ModelCheckError, match="rollout.max_tokens 300 leaves no room"):
        check_run(_spec(tiny_model_path, max_tokens=300), _rows("1+1="), [])


def test_a_tokenizer_larger_than_the_embedding_is_refused(model_copy):
    _edit_json(model_copy / "config.json", vocab_size=64)
    with pytest.raises(ModelCheckError, match="99 tokens but the model only 64 embedding rows"):
        check_run(_spec(str(model_copy)), _rows("1+1="), [])


def test_a_folder_without_a_tokenizer_is_refused(model_copy):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_copy / name).unlink()
    with pytest.raises(ModelCheckError, match="has no tokenizer"):
        check_run(_spec(str(model_copy)), _rows("1+1="), [])


def test_an_architecture_vllm_cannot_generate_with_is_refused(model_copy):
    _edit_json(model_copy / "config.json", architectures=["BertModel"])
    with pytest.raises(ModelCheckError, match="architecture BertModel is not one vLLM generates with"):
        check_run(_spec(str(model_copy)), _rows("1+1="), [])


def test_chat_rows_on_a_model_without_a_chat_template_are_refused(tiny_model_path):
    rows = [{"prompt": "q", "messages": [{"role": "user", "content": "q"}], "answer": "1"}]
    with pytest.raises(ModelCheckError, match="needs a chat template"):
        check_run(_spec(tiny_model_path), rows, [])


def test_a_hub_id_without_a_local_copy_says_how_to_provide_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelCheckError, match=r"no local copy.*huggingface-cli download Qwen/Qwen2-0.5B.*HF_HOME"):
        resolve_model_path("Qwen/Qwen2-0.5B")


def test_a_hub_id_in_the_local_cache_resolves_to_its_snapshot(tiny_model_path, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    repo = tmp_path / "hub" / "models--acme--tiny"
    shutil.copytree(tiny_model_path, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_path("acme/tiny") == str(repo / "snapshots" / ("0" * 40))


def test_a_folder_without_config_is_not_a_model(tmp_path):
    with pytest.raises(ModelCheckError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_the_architectures_read_from_vllms_registry_source_are_those_vllm_imports():
    """The coordinator reads vLLM's generation architectures from its registry's source
    instead of importing vLLM (7 s or more): the same set, and a subprocess that checks a
    run never imports vLLM."""
    import subprocess
    import sys

    from workers.models import preflight

    read = preflight._generation_architectures()
    assert {"Qwen2ForCausalLM", "LlamaForCausalLM", "GPT2LMHeadModel"} <= read
    assert read == preflight._imported_generation_architectures()
    code = ("import sys; from workers.models.preflight import _generation_architectures as g; "
            "assert 'Qwen2ForCausalLM' in g(); sys.exit(1 if 'vllm' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=str(Path(__file__).resolve().parents[3])).returncode == 0
