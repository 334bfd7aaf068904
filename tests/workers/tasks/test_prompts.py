"""Prompts through the model's own tokenizer: formats, templates, stop ids, token pieces."""
import json
import shutil

import pytest

from workers.models import tinymodel
from workers.tasks.prompts import PromptError, PromptRenderer, compile_template, load_tokenizer, stop_token_ids
from workers.spec import SpecError, validate_spec
from workers.tasks.datasets import DatasetError, load_rows

CHATML = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_path):
    return load_tokenizer(tiny_model_path)


@pytest.fixture()
def chat_model(tiny_model_path, tmp_path):
    """The tiny model's folder with a chat template and two end-of-sequence ids."""
    folder = tmp_path / "chat"
    shutil.copytree(tiny_model_path, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = [3, 2]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return str(folder)


def test_raw_prompts_get_the_same_ids_as_the_tiny_models_own_encoder(tiny_tokenizer):
    renderer = PromptRenderer(tiny_tokenizer)
    for prompt in ["12+7=", "3+14+5=", "5 3 9>11:", "a~b ?"]:
        assert renderer.ids({"prompt": prompt}) == tinymodel.encode(prompt)


def test_decode_leaves_out_end_of_sequence_tokens(tiny_tokenizer):
    renderer = PromptRenderer(tiny_tokenizer)
    assert renderer.decode(tinymodel.encode("19") + [tinymodel.EOS_ID]) == "19"


def test_pieces_are_one_per_token_and_join_to_the_text(tiny_tokenizer):
    renderer = PromptRenderer(tiny_tokenizer)
    ids = tinymodel.encode("17 22") + [tinymodel.EOS_ID]
    pieces = renderer.pieces(ids)
    assert pieces == ["1", "7", " ", "2", "2", "</s>"]


def test_prompt_template_renders_row_fields(tiny_tokenizer):
    renderer = PromptRenderer(tiny_tokenizer, template="Q: {{ prompt }} ({{ level }})\nA:")
    assert renderer.text({"prompt": "2+2=", "level": 1}) == "Q: 2+2= (1)\nA:"


def test_prompt_template_with_an_unknown_field_is_a_clear_error(tiny_tokenizer):
    renderer = PromptRenderer(tiny_tokenizer, template="{{ question }}")
    with pytest.raises(PromptError, match="question"):
        renderer.ids({"prompt": "2+2="})


def test_prompt_template_that_does_not_compile_is_refused_in_the_spec():
    with pytest.raises(SpecError) as err:
        validate_spec({"name": "x", "model": {"path": "builtin:tiny"},
                       "task": {"dataset": "gen:add", "prompt_template": "{{ prompt "}})
    assert err.value.errors[0]["field"] == "task.prompt_template"
    assert "line 1" in err.value.errors[0]["message"]


@pytest.mark.parametrize("template", ["{{ 'a' * 10**10 }}", "{{ 2 ** 100000000 }}", "{{ [1] * 10**9 }}",
                                      "{{ prompt * 10**9 }}"])
def test_templates_that_build_huge_values_are_refused_quickly(tiny_tokenizer, template):
    import time

    t0 = time.perf_counter()
    with pytest.raises(Exception, match="not allowed|may not build"):
        validate_spec({"name": "x", "model": {"path": "builtin:tiny"},
                       "task": {"dataset": "gen:add", "prompt_template": template}})
        PromptRenderer(tiny_tokenizer, template=template).ids({"prompt": "2+2="})
    assert time.perf_counter() - t0 < 2


def test_prompt_template_cannot_reach_python_internals():
    template = compile_template("{{ prompt.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|undefined"):
        template.render(prompt="x")


def test_chat_rows_render_with_the_chat_template_and_a_generation_prompt(chat_model):
    renderer = PromptRenderer(load_tokenizer(chat_model))
    row = {"prompt": "What is 2+2?", "system": "Be brief."}
    assert renderer.is_chat(row)
    assert renderer.text(row) == "<|system|>Be brief.\n<|user|>What is 2+2?\n<|assistant|>"
    messages = {"prompt": "ignored", "messages": [{"role": "user", "content": "hi"}]}
    assert renderer.text(messages) == "<|user|>hi\n<|assistant|>"


def test_system_prompt_from_the_spec_makes_plain_rows_chat(chat_model):
    renderer = PromptRenderer(load_tokenizer(chat_model), system_prompt="S")
    assert renderer.text({"prompt": "q"}) == "<|system|>S\n<|user|>q\n<|assistant|>"


def test_a_chat_row_without_a_chat_template_is_refused(tiny_tokenizer):
    renderer = PromptRenderer(tiny_tokenizer)
    with pytest.raises(PromptError, match="chat template"):
        renderer.ids({"prompt": "q", "messages": [{"role": "user", "content": "q"}]})


def test_raw_format_ignores_a_rows_system_field(chat_model):
    renderer = PromptRenderer(load_tokenizer(chat_model), fmt="raw")
    assert renderer.text({"prompt": "q", "system": "S"}) == "q"


def test_stop_ids_are_every_declared_end_of_sequence_id_once(chat_model, tiny_model_path):
    assert stop_token_ids(chat_model, load_tokenizer(chat_model)) == [3, 2]
    assert stop_token_ids(tiny_model_path, load_tokenizer(tiny_model_path)) == [2]


def test_a_folder_without_a_tokenizer_is_named(tiny_model_path, tmp_path):
    folder = tmp_path / "bare"
    folder.mkdir()
    shutil.copy(f"{tiny_model_path}/config.json", folder)
    with pytest.raises(PromptError, match="has no tokenizer"):
        load_tokenizer(str(folder))


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_chat_datasets_take_the_last_user_message_as_the_prompt(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": f"q{i}"}], "answer": str(i)}
            for i in range(10)]
    train, held_out = load_rows(_write(tmp_path / "chat.jsonl", rows), eval_size=2)
    assert [r["prompt"] for r in held_out] == ["q8", "q9"]
    assert train[0]["messages"][1]["content"] == "q0"


@pytest.mark.parametrize("messages, message", [
    ([], "non-empty list"),
    ([{"role": "user"}], "string 'role' and 'content'"),
    ([{"role": "wizard", "content": "x"}], "role 'wizard'"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "last message must be the user's"),
])
def test_malformed_chat_rows_are_refused_with_their_row_number(tmp_path, messages, message):
    rows = [{"prompt": "ok", "answer": "1"}, {"messages": messages, "answer": "1"}]
    with pytest.raises(DatasetError, match=f"row 2: .*{message}"):
        load_rows(_write(tmp_path / "bad.jsonl", rows), eval_size=0)
