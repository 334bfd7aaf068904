"""Every template a user controls (a spec's task.prompt_template, a model folder's chat
template) is compiled and rendered in the bounded child of workers.tasks.template_child, on
worker hosts as in the web process: one memory and time budget, a whole dataset in one
child, nothing compiled in the calling process, the same text as transformers renders."""
import json
import resource
import shutil
import subprocess
import time

import pytest

from workers.models.preflight import ModelCheckError, check_run
from workers.spec import validate_spec
from workers.tasks import template_child
from workers.tasks.datasets import load_rows
from workers.tasks.prompts import PromptError, PromptRenderer, load_tokenizer

CHATML = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def model_with_chat_template(tiny_model_path, folder, template):
    shutil.copytree(tiny_model_path, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return str(folder)


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("template", [
    CHATML,
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYS]{{ m['content'] | trim }}\n"
    "{% elif m.tool_calls %}{{ m.tool_calls | tojson }}{% else %}{% generation %}{{ m['content'] }}"
    "{% endgeneration %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}{% if tools is not none %}{{ tools }}{% endif %}",
    "{% set ns = namespace(n=0) %}{%- for m in messages -%}\n  {%- set ns.n = ns.n + 1 -%}\n"
    "  {{ loop.index }}/{{ ns.n }} {{ m.content|tojson(indent=1) }}\n{%- if loop.last %}{% break %}{% endif %}\n"
    "{% endfor %}{{ messages[0].missing }}|{% if messages|length > 5 %}{{ raise_exception('too long') }}{% endif %}",
])
def test_a_chat_template_renders_in_the_child_as_transformers_renders_it(tiny_model_path, tmp_path, template):
    tokenizer = load_tokenizer(model_with_chat_template(tiny_model_path, tmp_path / "m", template))
    rows = [{"prompt": "1+1=", "system": "  Be brief. "}, {"prompt": "x", "messages": [
        {"role": "user", "content": "h\u00e9 \"q\""}, {"role": "assistant", "content": "a"},
        {"role": "user", "content": "2+2="}]}]
    renderer = PromptRenderer(tokenizer)
    for row in rows:
        messages = row.get("messages") or [{"role": "system", "content": row["system"]},
                                           {"role": "user", "content": row["prompt"]}]
        assert renderer.text(row) == tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                  tokenize=False)


BOMBS = {
    "memory": "{{ 'x' * 300000000 }}",
    "range": "{% for i in range(10**9) %}{% endfor %}",
    "loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "growth": "{% set ns = namespace(s=[]) %}{% for i in range(99999) %}{% set ns.s = ns.s + ['x' * 99999] %}"
              "{% endfor %}",
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_the_worker_preflight_refuses_a_chat_template_bomb_within_the_budget(tiny_model_path, tmp_path, name,
                                                                             monkeypatch):
    monkeypatch.setattr(template_child, "TEMPLATE_TIMEOUT_S", 1.5)
    path = model_with_chat_template(tiny_model_path, tmp_path / "bomb", BOMBS[name])
    spec = validate_spec({"name": "b", "model": {"path": path}, "task": {"dataset": "gen:add", "size": 50,
                                                                          "prompt_format": "chat"}})
    train, held_out = load_rows(spec.task.dataset, 50, 10)
    before, started = peak_mb(), time.monotonic()
    with pytest.raises(ModelCheckError) as refused:
        check_run(spec, train, held_out, check_architecture=False)
    assert time.monotonic() - started < 1.5 + template_child.STARTUP_S + 2
    assert peak_mb() - before < 50
    message = str(refused.value)
    assert "chat template" in message and "the budget is 512 MB and 1.5 s per render" in message, message


def test_a_whole_dataset_renders_in_one_child(tiny_model_path, tmp_path, monkeypatch):
    path = model_with_chat_template(tiny_model_path, tmp_path / "chat", CHATML)
    spec = validate_spec({"name": "b", "model": {"path": path}, "task": {
        "dataset": "gen:add", "system_prompt": "S", "prompt_template": "Q: {{ prompt }}"}})
    train, held_out = load_rows(spec.task.dataset, spec.task.size, spec.task.eval_size)
    children = []
    real = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: children.append(a) or real(*a, **k))
    started = time.monotonic()
    checked = check_run(spec, train, held_out, check_architecture=False)
    assert time.monotonic() - started < 10
    assert len(children) == 1  # the template was checked when the spec was; every row in one child
    row = checked.train_rows[0]
    assert checked.renderer.ids(row) == load_tokenizer(path).encode(
        f"<|system|>S\n<|user|>Q: {row['prompt']}\n<|assistant|>", add_special_tokens=False)
    # a row's text stays once its ids are cached: a reported sample shows it, with no child more
    assert checked.renderer.text(row) == f"<|system|>S\n<|user|>Q: {row['prompt']}\n<|assistant|>"
    assert len(children) == 1


def test_a_template_slow_on_every_row_is_stopped_by_the_batchs_budget(tiny_model_path, monkeypatch):
    monkeypatch.setattr(template_child, "TEMPLATE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(template_child, "TEMPLATE_ROW_S", 0.001)
    slow = "{% for i in range(3000) %}{% for j in range(100) %}{% endfor %}{% endfor %}{{ prompt }}"  # ~20 ms a row
    renderer = PromptRenderer(load_tokenizer(tiny_model_path), template=slow)
    started = time.monotonic()
    with pytest.raises(PromptError, match="took over 1.5 s"):  # the wall clock or RLIMIT_CPU, whichever is first
        renderer.prepare([{"prompt": str(i)} for i in range(500)])
    assert time.monotonic() - started < 1.5 + template_child.STARTUP_S + 1
