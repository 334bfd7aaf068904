"""The zoo's tool-calling model (workers/models/toolzoo.py): Qwen2's tool format in its
chat template and tokenizer, episodes encoded turn by turn as the engine builds them, a
cached build, and a warm start whose greedy first turn is a calculator call."""
import json
import random

import pytest

from workers.models import toolzoo
from workers.models.toolzoo import CALCULATOR_SCHEMA, TOOL_TAGS, Question


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A 3-step build in a temporary model cache (the recipe's other parts unchanged)."""
    return toolzoo.ensure_tool_model(tmp_path_factory.mktemp("cache"), steps=3)


@pytest.fixture(scope="module")
def tokenizer(built):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(built)


def test_build_is_cached_with_a_manifest_and_checksum(built, tmp_path):
    from workers.models.tinymodel import file_sha256

    manifest = json.loads((built / toolzoo.MANIFEST).read_text())
    assert manifest["name"] == "qwen2-tools" and manifest["sft_steps"] == 3
    assert manifest["sha256"] == file_sha256(built / "model.safetensors")
    assert manifest["recipe"] == toolzoo.tool_recipe(steps=3)
    # the same call finds the cache: the folder is not rebuilt
    before = (built / "model.safetensors").stat().st_mtime_ns
    assert toolzoo.ensure_tool_model(built.parent, steps=3) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == before


def test_damaged_cache_is_rebuilt(tmp_path):
    out = toolzoo.ensure_tool_model(tmp_path, steps=1)
    (out / "model.safetensors").write_bytes(b"not the weights")
    again = toolzoo.ensure_tool_model(tmp_path, steps=1)
    assert again == out
    assert json.loads((out / toolzoo.MANIFEST).read_text())["sft_steps"] == 1
    from workers.models.tinymodel import verify_model_folder

    verify_model_folder(out, toolzoo.MANIFEST)  # checksum holds again


def test_template_renders_tools_a_tool_call_and_a_tool_message(tokenizer):
    messages = [{"role": "user", "content": "What is 347 * 29?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "347 * 29"}}}]},
                {"role": "tool", "content": "10063"},
                {"role": "assistant", "content": "10063"}]
    text = tokenizer.apply_chat_template(messages, tools=[CALCULATOR_SCHEMA], tokenize=False)
    assert text == (
        "<|im_start|>system\n" + toolzoo.tool_system_prompt() + "<|im_end|>\n"
        "<|im_start|>user\nWhat is 347 * 29?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "347 * 29"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n10063\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n10063<|im_end|>\n")
    assert '<tools>\n{"type": "function", "function": {"name": "calculator"' in text


def test_tool_system_prompt_gives_the_same_tokens_as_passing_tools(tokenizer):
    user = [{"role": "user", "content": "What is 347 * 29?"}]
    with_tools = tokenizer.apply_chat_template(user, tools=[CALCULATOR_SCHEMA], add_generation_prompt=True)
    as_system = tokenizer.apply_chat_template([{"role": "system", "content": toolzoo.tool_system_prompt()}] + user,
                                              add_generation_prompt=True)
    assert with_tools == as_system
    plain = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    assert plain == "<|im_start|>user\nWhat is 347 * 29?<|im_end|>\n<|im_start|>assistant\n"


def test_consecutive_tool_messages_share_one_user_turn(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "c"},
                                          {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
                         "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_tool_tags_are_single_tokens_kept_when_special_tokens_are_skipped(tokenizer):
    call = toolzoo.tool_call_text("calculator", {"expression": "347 * 29"})
    ids = tokenizer.encode(call + "<|im_end|>", add_special_tokens=False)
    for tag in TOOL_TAGS[:2]:
        assert ids.count(tokenizer.convert_tokens_to_ids(tag)) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == call
    assert [tokenizer.decode([i]) for i in tokenizer.encode("347", add_special_tokens=False)] == ["3", "4", "7"]


def test_episode_ids_built_turn_by_turn_equal_the_whole_encoding_and_train_only_the_assistant(tokenizer):
    q = Question(347, 29, "*")
    segments = toolzoo.episode_segments(q, tools=True)
    assert [trained for _, trained in segments] == [False, True, False, True]
    assert segments[2][0] == "\n<|im_start|>user\n<tool_response>\n10063\n</tool_response><|im_end|>\n" \
                             "<|im_start|>assistant\n"
    (ids, mask), = toolzoo.encode_episodes(tokenizer, [segments])
    assert ids == tokenizer.encode("".join(t for t, _ in segments), add_special_tokens=False)
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert trained == toolzoo.tool_call_text("calculator", {"expression": "347 * 29"}) + "<|im_end|>10063<|im_end|>"
    (ids, mask), = toolzoo.encode_episodes(tokenizer, [toolzoo.episode_segments(q, tools=False)])
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "10063<|im_end|>"


def test_first_call_result_runs_the_call_or_names_what_is_wrong():
    assert toolzoo.first_call_result(toolzoo.tool_call_text("calculator", {"expression": "347 * 29"})) == "10063"
    assert toolzoo.first_call_result("10063") is None
    assert toolzoo.first_call_result("<tool_call>\n{\"name\": \"calculator\"\n</tool_call>") == "error: JSONDecodeError"
    assert toolzoo.first_call_result(toolzoo.tool_call_text("search", {"q": "x"})) == "error: unknown tool 'search'"


def test_recipe_is_deterministic_in_the_seed():
    r = toolzoo.tool_recipe()
    assert toolzoo.questions(5, random.Random(3), r) == toolzoo.questions(5, random.Random(3), r)
    held_out = set(toolzoo.held_out_questions(r))
    assert all(100 <= q.a <= 999 and 10 <= q.b <= 99 for q in held_out)


def test_shipped_warm_start_calls_the_calculator_on_held_out_prompts_and_beats_no_tools():
    """The default recipe's model (the shipped copy, installed into a fresh cache): greedy
    first turns on held-out prompts are parsable calculator calls, and the episode is more
    often right with the tool than without."""
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as root:
        folder = toolzoo.ensure_tool_model(root)
        manifest = json.loads((folder / toolzoo.MANIFEST).read_text())
        tok, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
    qs = toolzoo.held_out_questions(manifest["recipe"])[:32]
    with_tools = toolzoo.episode_accuracy(model, tok, qs, tools=True, details=True)
    without = toolzoo.episode_accuracy(model, tok, qs, tools=False, details=True)
    assert with_tools["tool_call_share"] == 1.0 and without["tool_call_share"] == 0.0
    first = with_tools["example"]["first_turn"]
    call = json.loads(first.split("<tool_call>")[1].split("</tool_call>")[0])
    assert call["name"] == "calculator" and set(call["arguments"]) == {"expression"}
    assert with_tools["accuracy"] > without["accuracy"] + 0.1
    assert manifest["held_out_accuracy"] > manifest["held_out_accuracy_no_tools"] + 0.1


def test_the_agentic_example_offers_the_calculator_as_the_model_was_warm_started():
    from pathlib import Path

    from workers.spec import validate_spec

    spec = validate_spec((Path(__file__).resolve().parents[3] / "examples" / "agentic-tools.yaml").read_text())
    assert spec.model.path == toolzoo.BUILTIN
    assert spec.task.system_prompt == toolzoo.tool_system_prompt()
    assert spec.task.environment.name == "tools" and spec.task.environment.tools == ["calculator"]


def test_build_model_command_and_builtin_path_install_the_shipped_warm_start(tmp_path, monkeypatch, capsys):
    from workers.cli.engine import main
    from workers.models.preflight import resolve_model_path

    monkeypatch.setenv("FLUXRL_MODEL_CACHE", str(tmp_path))
    assert main(["build-model", "qwen2-tools"]) == 0
    folder = capsys.readouterr().out.strip().splitlines()[-1]
    assert folder.startswith(str(tmp_path)) and resolve_model_path(toolzoo.BUILTIN) == folder
    shipped = json.loads((toolzoo.shipped_tool_model(toolzoo.tool_recipe()) / toolzoo.MANIFEST).read_text())
    assert json.loads((tmp_path / folder / toolzoo.MANIFEST).read_text())["sha256"] == shipped["sha256"]
