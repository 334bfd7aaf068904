"""Observations rendered once by each model's chat template: the ids appended after a turn
are the template's own text for the conversation, so prompt + turn + observation decodes
to exactly what the template renders for the whole conversation."""
import pytest

from workers.agents.api import Observation
from workers.agents.render import ObservationRenderer, TemplateNotPrefixStable, chat_delta
from workers.models.modelzoo import ensure_zoo_model
from workers.models.zoo_data import FORMATS, render_chat
from workers.tasks.prompts import _special_tokens, load_tokenizer


@pytest.fixture(autouse=True)
def templates_compile_in_process(monkeypatch):
    from workers.tasks import prompts

    monkeypatch.setattr(prompts, "_template_checker", None)


@pytest.fixture(scope="module", params=["qwen2", "llama", "gpt2"])
def zoo(request):
    tokenizer = load_tokenizer(str(ensure_zoo_model(request.param)))
    return request.param, tokenizer, ObservationRenderer(tokenizer, tokenizer.get_chat_template(),
                                                         _special_tokens(tokenizer))


def _conversation(arch, tokenizer, messages):
    """The whole conversation as the template renders it, with the next generation prompt."""
    return render_chat(FORMATS[arch].template, messages, add_generation_prompt=True, **_special_tokens(tokenizer))


def _tool_message(arch, content):
    # the gpt2 zoo template has no tool role: Qwen2's rule, a user message wrapped in <tool_response>
    if arch == "gpt2":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    return {"role": "tool", "content": content}


def test_an_observation_after_an_ended_turn_continues_the_template_exactly(zoo):
    arch, tokenizer, renderer = zoo
    user, answer, tool = "What is 347 * 29?", "Let me compute.", "10063"
    prompt = tokenizer.encode(_conversation(arch, tokenizer, [{"role": "user", "content": user}]),
                              add_special_tokens=False)
    # the model's turn: its text and the end-of-turn token, as the engine would return them
    eot = tokenizer.convert_tokens_to_ids(FORMATS[arch].end_of_turn)
    turn = tokenizer.encode(answer, add_special_tokens=False) + [eot]
    ids, shown = renderer.ids(Observation(tool, "tool"), True, turn, max_tokens=256)
    assert shown.content == tool
    whole = _conversation(arch, tokenizer, [{"role": "user", "content": user},
                                            {"role": "assistant", "content": answer}, _tool_message(arch, tool)])
    assert tokenizer.decode(prompt, skip_special_tokens=False) + answer == whole[:whole.index(answer) + len(answer)]
    # what follows the answer, its end-of-turn token (generated) then the observation's ids
    assert tokenizer.decode([eot] + ids, skip_special_tokens=False) == whole[whole.index(answer) + len(answer):]
    # the same ids the tokenizer gives the whole conversation's end: the token boundaries agree
    assert tokenizer.encode(whole, add_special_tokens=False)[-len(ids):] == ids


def test_a_length_cut_turn_gets_the_end_of_turn_text_from_the_observation(zoo):
    arch, tokenizer, renderer = zoo
    turn = tokenizer.encode("I will", add_special_tokens=False)  # no end-of-turn token: cut by its budget
    ids, _ = renderer.ids(Observation("go on", "user"), True, turn, max_tokens=256)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith(FORMATS[arch].end_of_turn)
    ended = tokenizer.decode(renderer.ids(Observation("go on", "user"), True,
                                          turn + [tokenizer.convert_tokens_to_ids(FORMATS[arch].end_of_turn)], 256)[0],
                             skip_special_tokens=False)
    assert text == FORMATS[arch].end_of_turn + ended


def test_a_long_observation_is_cut_to_its_budget_and_says_so():
    tokenizer = load_tokenizer(str(ensure_zoo_model("qwen2")))
    renderer = ObservationRenderer(tokenizer, tokenizer.get_chat_template(), _special_tokens(tokenizer))
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    long = " ".join(str(i) for i in range(400))
    ids, shown = renderer.ids(Observation(long, "tool"), True, [eot], max_tokens=40)
    assert len(ids) <= 40
    assert "[cut:" in shown.content and shown.content.startswith("0 1 2")
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("\n<|im_start|>tool\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_a_raw_prompt_observation_is_its_content_and_a_newline(tiny_model_path):
    tokenizer = load_tokenizer(tiny_model_path)
    renderer = ObservationRenderer(tokenizer, None)
    ids, shown = renderer.ids(Observation("12", "tool"), False, [5, 6], max_tokens=16)
    assert ids == tokenizer.encode("12\n", add_special_tokens=False)
    assert shown.content == "12"


def test_a_template_that_rewrites_earlier_turns_fails_loudly():
    def render(messages):  # a template that numbers the turns from the end: not prefix-stable
        n = len(messages)
        return "".join(f"[{n - i}]{m['role']}:{m['content']}\n" for i, m in enumerate(messages)) + "assistant:"

    with pytest.raises(TemplateNotPrefixStable):
        chat_delta(render, "tool")
