"""The model zoo: small Qwen2 / Llama / GPT-2 models with trained tokenizers and chat
templates, saved as HF folders that transformers (and vLLM) load like any other. That vLLM
on the CPU generates what transformers generates greedily on each is asserted by their RL
runs (test_model_zoo_engine.py), whose engine does exactly that before training."""
import json
import os

import pytest

from workers.models import modelzoo, zoo_data, zoo_tokenizers
from workers.models.modelzoo import ARCHS, build_zoo_model, ensure_zoo_model
from workers.models.zoo_data import chat_arithmetic_rows, write_chat_dataset

MESSAGES = [{"role": "system", "content": "You are a careful calculator."},
            {"role": "user", "content": "What is 23 + 45?"}]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """As the builder itself: one thread (on a busy 2-core machine, two are 8x slower)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each architecture built once with a 5-step warm start (folders, by arch)."""
    root = tmp_path_factory.mktemp("zoo")
    return {arch: build_zoo_model(arch, root / arch, steps=5) for arch in ARCHS}


@pytest.fixture(scope="module")
def tokenizers(built):
    from transformers import AutoTokenizer

    return {arch: AutoTokenizer.from_pretrained(folder) for arch, folder in built.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trips_text_with_digits_and_unicode(tokenizers, arch):
    tok = tokenizers[arch]
    text = "Zürich café: 12345 + 6 = 12351 — naïve “quotes”, 日本語 🙂\n\n  two spaces"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("arch", ARCHS)
def test_numbers_are_split_into_single_digits(tokenizers, arch):
    tok = tokenizers[arch]
    pieces = [tok.decode([i]).strip() for i in tok.encode("What is 1234?", add_special_tokens=False)]
    assert [p for p in pieces if p.isdigit()] == ["1", "2", "3", "4"]


def test_tokenizers_are_a_byte_level_bpe_and_a_sentencepiece_style_unigram(built):
    models = {arch: json.loads((built[arch] / "tokenizer.json").read_text())["model"] for arch in ARCHS}
    assert models["qwen2"]["type"] == models["gpt2"]["type"] == "BPE"
    assert models["llama"]["type"] == "Unigram" and models["llama"]["byte_fallback"]
    assert 1900 <= len(models["qwen2"]["vocab"]) <= 2100 and 900 <= len(models["llama"]["vocab"]) <= 1100


def test_llama_adds_a_bos_to_raw_text_but_a_chat_prompt_has_exactly_one(tokenizers):
    tok = tokenizers["llama"]
    assert tok.encode("What is 2 + 3?")[0] == tok.bos_token_id
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template_renders_system_user_and_the_generation_prompt(built, tokenizers, arch):
    tok = tokenizers[arch]
    assert "chat_template" in json.loads((built[arch] / "tokenizer_config.json").read_text())
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    without = tok.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert "You are a careful calculator." in text and "What is 23 + 45?" in text
    assert text.index("careful calculator") < text.index("What is 23")
    assert text.startswith(without) and len(text) > len(without)  # the assistant's header comes last
    assert text.endswith({"qwen2": "<|im_start|>assistant\n", "llama": "<|end_header_id|>\n\n",
                          "gpt2": "<|assistant|>\n"}[arch])
    # The module renders the template as transformers does (its tokenizer corpus relies on it).
    fmt = zoo_data.FORMATS[arch]
    assert zoo_data.render_chat(fmt.template, MESSAGES, add_generation_prompt=True, bos_token=fmt.bos or "") == text


@pytest.mark.parametrize("arch", ARCHS)
def test_generation_config_lists_the_end_of_turn_and_end_of_text_ids(built, tokenizers, arch):
    tok = tokenizers[arch]
    eos = json.loads((built[arch] / "generation_config.json").read_text())["eos_token_id"]
    assert isinstance(eos, list) and len(eos) == 2
    assert eos[0] == tok.eos_token_id  # end of turn, also the tokenizer's eos_token
    assert tok.convert_ids_to_tokens(eos[1]) in ("<|endoftext|>", "</s>")
    assert json.loads((built[arch] / "config.json").read_text())["eos_token_id"] == eos[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_vocab_size_covers_the_tokenizer_rounded_up_to_64(built, tokenizers, arch):
    vocab = json.loads((built[arch] / "config.json").read_text())["vocab_size"]
    assert vocab >= len(tokenizers[arch]) and vocab % 64 == 0 and vocab - len(tokenizers[arch]) < 64


@pytest.mark.parametrize("arch,cls", [("qwen2", "Qwen2ForCausalLM"), ("llama", "LlamaForCausalLM"),
                                      ("gpt2", "GPT2LMHeadModel")])
def test_built_folder_loads_in_transformers_and_generates_until_an_eos(built, tokenizers, arch, cls):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built[arch])
    assert type(model).__name__ == cls and model.config.hidden_size == 128
    assert model.config.hidden_size // model.config.num_attention_heads == 64  # a head size vLLM's CPU kernels have
    tok = tokenizers[arch]
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert out.shape[1] > len(ids)
    manifest = json.loads((built[arch] / modelzoo.MANIFEST).read_text())
    assert manifest["recipe"]["steps"] == 5 and 0.0 <= manifest["held_out_accuracy"] <= 1.0
    assert manifest["architecture"] == cls and manifest["sha256"]


def test_sft_targets_are_the_whole_equation_then_the_end_of_turn_token(tokenizers):
    for arch in ARCHS:
        tok = tokenizers[arch]
        rows = zoo_data.arith_rows(3, __import__("random").Random(0), system_share=1.0)
        for row, (ids, prompt_len) in zip(rows, modelzoo.sft_examples(tok, rows, arch)):
            a, b = row["operands"]
            assert ids[-1] == tok.eos_token_id
            assert tok.decode(ids[prompt_len:-1]) == f"{a} + {b} = {a + b}"
            prompt = tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
            assert ids[:prompt_len] == tok.encode(prompt, add_special_tokens=False)


def test_held_out_and_dev_sums_with_a_two_digit_operand_are_never_trained_on():
    import random

    recipe = modelzoo.zoo_recipe("qwen2")
    watched = modelzoo.held_out_rows(recipe) + modelzoo.dev_rows(recipe)
    keys = {zoo_data.held_out_key(r) for r in watched}
    train = zoo_data.arith_rows(5000, random.Random(1), recipe["system_share"], frozenset(keys))
    assert not any(zoo_data.held_out_key(r) in keys for r in train)
    pairs = {r["operands"] for r in watched if max(r["operands"]) >= 10}
    assert pairs and not pairs & {r["operands"] for r in train}


def test_the_warm_start_stops_once_dev_accuracy_reaches_its_target(monkeypatch):
    """A stop on accuracy, checked every `check_every` steps; an explicit step count runs exactly."""
    recipe = {**modelzoo.zoo_recipe("gpt2"), "steps": 40, "check_from": 10, "check_every": 10, "dev": 4,
              "held_out": 4}
    checks = iter([0.1, 0.2, 0.5, 0.9])
    monkeypatch.setattr(modelzoo, "greedy_accuracy", lambda *a, **k: next(checks, 0.0))
    tok = zoo_tokenizers.build_tokenizer(recipe)
    report = modelzoo._sft(modelzoo.build_model(recipe, tok), tok, recipe, progress=False)
    assert report["sft_steps"] == 30 and report["dev_accuracy"] == 0.5 >= recipe["stop_at_accuracy"]
    assert modelzoo.zoo_recipe("gpt2", steps=5)["stop_at_accuracy"] is None


def test_chat_rows_are_deterministic_jsonl_rows_with_the_sum_as_answer(tmp_path):
    rows = chat_arithmetic_rows(200, seed=3)
    assert rows == chat_arithmetic_rows(200, seed=3) and rows != chat_arithmetic_rows(200, seed=4)
    for row in rows:
        assert set(row) == {"messages", "answer"} and row["messages"][-1]["role"] == "user"
        a, b = map(int, row["messages"][-1]["content"].removeprefix("What is ").rstrip("?").split(" + "))
        assert row["answer"] == str(a + b) and max(a, b) < 100
    with_system = [r for r in rows if r["messages"][0]["role"] == "system"]
    assert 0.15 < len(with_system) / len(rows) < 0.45
    path = write_chat_dataset(tmp_path / "add.jsonl", 50, seed=3)
    assert [json.loads(line) for line in path.read_text().splitlines()] == chat_arithmetic_rows(50, seed=3)


def test_two_digit_chat_rows_have_a_two_digit_operand_in_every_row():
    rows = chat_arithmetic_rows(300, seed=7, two_digit=True)
    assert len(rows) == 300 and rows == chat_arithmetic_rows(300, seed=7, two_digit=True)
    operands = [tuple(map(int, r["messages"][-1]["content"].removeprefix("What is ").rstrip("?").split(" + ")))
                for r in rows]
    assert all(max(pair) >= 10 for pair in operands)
    assert any(min(pair) < 10 for pair in operands)  # one operand may still have one digit


def test_a_chat_dataset_file_loads_as_a_fluxrl_dataset(tmp_path):
    from workers.tasks.datasets import load_rows

    path = write_chat_dataset(tmp_path / "add.jsonl", 60, seed=1)
    train, held_out = load_rows(str(path), size=50, eval_size=10, seed=0)
    assert len(train) + len(held_out) == 60 and all("messages" in r for r in train)


def test_an_unknown_architecture_is_refused():
    with pytest.raises(ValueError, match="qwen2, llama, gpt2"):
        modelzoo.zoo_recipe("bert")


@pytest.fixture
def fake_build(monkeypatch):
    """build_zoo_model replaced by one that writes a small folder and counts its calls."""
    calls = []

    def fake(arch, out_dir, *, steps=None, seed=0, progress=False):
        from workers.models.tinymodel import file_sha256

        calls.append(arch)
        out_dir.mkdir(parents=True)
        (out_dir / modelzoo.WEIGHTS).write_bytes(os.urandom(64))
        manifest = {"recipe": modelzoo.zoo_recipe(arch, steps, seed), "sha256": file_sha256(out_dir / modelzoo.WEIGHTS)}
        (out_dir / modelzoo.MANIFEST).write_text(json.dumps(manifest))
        return out_dir

    monkeypatch.setattr(modelzoo, "build_zoo_model", fake)
    return calls


def test_ensure_builds_once_into_the_cache_and_rebuilds_a_damaged_copy(tmp_path, monkeypatch, fake_build):
    monkeypatch.setenv("FLUXRL_MODEL_CACHE", str(tmp_path))
    folder = ensure_zoo_model("gpt2", steps=7)  # a recipe nothing is shipped for
    assert folder.parent == tmp_path and folder.name.startswith("zoo-gpt2-") and fake_build == ["gpt2"]
    assert ensure_zoo_model("gpt2", steps=7) == folder and fake_build == ["gpt2"]  # cached
    (folder / modelzoo.WEIGHTS).write_bytes(b"truncated")
    assert ensure_zoo_model("gpt2", steps=7) == folder and fake_build == ["gpt2", "gpt2"]
    assert ensure_zoo_model("gpt2", steps=8) != folder  # another recipe, another folder
    assert not [p for p in tmp_path.iterdir() if ".staging-" in p.name or ".old-" in p.name]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_default_recipe_installs_the_shipped_warm_start_without_building(tmp_path, monkeypatch, fake_build, arch):
    from workers.models.tinymodel import file_sha256

    monkeypatch.setenv("FLUXRL_MODEL_CACHE", str(tmp_path))
    shipped = modelzoo.shipped_zoo_model(arch, modelzoo.zoo_recipe(arch, None, 0))
    assert shipped is not None
    folder = ensure_zoo_model(arch)
    assert fake_build == [] and folder.parent == tmp_path
    expected = json.loads((shipped / modelzoo.MANIFEST).read_text())["sha256"]
    assert file_sha256(folder / modelzoo.WEIGHTS) == expected
    (folder / modelzoo.WEIGHTS).write_bytes(b"truncated")  # a damaged cache: the shipped copy again
    assert ensure_zoo_model(arch) == folder and fake_build == []
    assert file_sha256(folder / modelzoo.WEIGHTS) == expected


def test_a_failed_build_installs_nothing(tmp_path, monkeypatch):
    def broken(arch, out_dir, **_):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("out of memory")

    monkeypatch.setattr(modelzoo, "build_zoo_model", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        ensure_zoo_model("qwen2", tmp_path, steps=7)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
