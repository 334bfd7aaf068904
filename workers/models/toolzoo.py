"""The zoo's tool-calling chat model: the zoo Qwen2 (workers/models/modelzoo.py) with
Qwen2's tool format, warm-started to call a calculator. Agentic RL's own demo model
(docs/guides/agentic.md).

- **Template**: ChatML extended as Qwen2.5's template is: ``tools`` passed to
  ``apply_chat_template`` add a ``# Tools`` section with each tool's JSON schema to the
  system message; an assistant calls a tool with
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; a ``tool`` message
  is rendered as a ``user`` turn holding ``<tool_response>\\n...\\n</tool_response>``.
  ``tool_system_prompt()`` is that system message as text, for a spec's
  ``task.system_prompt`` (the same tokens as passing ``tools``).
- **Tokenizer**: the zoo's byte-level BPE (digits one by one) trained on a corpus with
  tool episodes; the four tags are added tokens, one id each, and not special: decoding
  with ``skip_special_tokens`` keeps them, so the tool-call parser sees them.
- **Warm start**: a short SFT on ``gen:tool_arith``-style episodes: "What is 347 * 29?"
  → a calculator call → the tool's ``10063`` → the answer ``10063``, the loss on the two
  assistant turns only; a share of episodes offer no tool (no ``# Tools`` section) and the
  assistant answers directly, so the no-tool baseline is the same model asked without
  tools. Stopped while it is still learning: once greedy accuracy with the tool on dev
  episodes reaches ``stop_at_accuracy``. Each episode's ids are built turn by turn as the
  engine builds them (prompt, generated turn, observation rendered once) and checked equal
  to the whole conversation's encoding.

The default recipe's weights ship in ``workers/assets/zoo-qwen2-tools`` (the zoo's reason:
the same recipe on another CPU is another model); ``ensure_tool_model`` installs them after
checking their SHA-256.

    ensure_tool_model()                        # cached under $FLUXRL_MODEL_CACHE
    python -m workers build-model qwen2-tools [--out DIR]
    model: {path: "builtin:qwen2-tools"}       # in a spec
"""
from __future__ import annotations

import ast
import json
import logging
import operator
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.models import modelzoo, zoo_data, zoo_tokenizers
from workers.tasks.datasets import tool_arith_prompt

logger = logging.getLogger(__name__)

NAME = "qwen2-tools"
BUILTIN = "builtin:qwen2-tools"  # model.path in a spec
MANIFEST = modelzoo.MANIFEST
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
DEFAULT_SYSTEM = "You are a helpful assistant."

# The calculator's schema as a tools list passes it (OpenAI's function format).
CALCULATOR_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}

_TOOLS_HEAD = "\n\n# Tools\n\nYou may call the functions within <tools></tools>:\n<tools>"
_TOOLS_TAIL = ("\n</tools>\n\nTo call one, write:\n<tool_call>\n"
               "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")

# Qwen2.5's tool template on ChatML: prefix-stable (a conversation's rendering starts with
# the rendering of every shorter one), which the episode's observation rendering needs.
TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- '" + DEFAULT_SYSTEM + "' }}{%- endif %}"
    "{{- " + json.dumps(_TOOLS_HEAD) + " }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- " + json.dumps(_TOOLS_TAIL) + " + '<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] | default([]) %}"
    "{%- if call['function'] is defined %}{%- set call = call['function'] %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{- (call['arguments'] if call['arguments'] is string else call['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

RECIPE = {
    "name": NAME, "seed": 0, "arch": "qwen2", "tokenizer": "bpe", "vocab": 2048, "hidden": 128, "heads": 2,
    "head_dim": 64, "layers": 3, "kv_heads": 1, "tie": True, "max_positions": 512,
    # Planned over `schedule_steps`, stopped at the first check (every `check_every` steps
    # from `check_from`) where greedy accuracy with the tool on `dev` episodes reaches
    # `stop_at_accuracy`, after `steps` at most. The model learns to copy the operands into
    # the call first (every call right by step 250), then the tool's answer out of the
    # response, and that jumps: dev accuracy 0.27 at step 250, 0.56 at 260, where it stops
    # (held-out 0.59), with RL left the rest. Checked every 10 steps for that reason. With
    # a quarter of the episodes tool-free and lr 1.5e-3, the model had learned to guess the
    # product from the operands instead and copied almost no answer after 1200 steps.
    "batch": 16, "lr": 2e-3, "final_lr_ratio": 0.1, "betas": [0.9, 0.95],
    "steps": 2400, "schedule_steps": 3000, "stop_at_accuracy": 0.35, "check_from": 100, "check_every": 10,
    "dev": 64, "held_out": 200,
    "corpus": {"episodes": 3000, "prose": 8000},
    "tool_share": 0.85,  # episodes offering the calculator; the rest answer directly
    "system_share": 0.5,  # of the no-tool episodes: a plain system message, else none
    "digits": [3, 2], "ops": ["*"],
}


def tool_recipe(steps: int | None = None, seed: int = 0) -> dict:
    """The recipe; ``steps`` runs exactly that many SFT steps (no stop on accuracy)."""
    recipe = {**RECIPE, "seed": seed}
    if steps is not None:
        recipe.update(steps=int(steps), stop_at_accuracy=None)
    return recipe


# --- episodes -----------------------------------------------------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _calculate(expression: str) -> str:
    """Integer + - *: the warm start's own calculator (the run's is workers/agents/tools.py,
    which workers.models may not import)."""
    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and abs(node.value) < 10 ** 12:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError("unsupported expression")

    return str(walk(ast.parse(expression, mode="eval").body))


@dataclass(frozen=True)
class Question:
    a: int
    b: int
    op: str

    @property
    def expression(self) -> str:
        return f"{self.a} {self.op} {self.b}"

    @property
    def answer(self) -> str:
        return _calculate(self.expression)


def questions(n: int, rng: random.Random, recipe: dict, exclude: frozenset = frozenset()) -> list[Question]:
    da, db = recipe["digits"]
    out: list[Question] = []
    while len(out) < n:
        q = Question(rng.randrange(10 ** (da - 1), 10 ** da), rng.randrange(10 ** (db - 1), 10 ** db),
                     rng.choice(recipe["ops"]))
        if q not in exclude:
            out.append(q)
    return out


def prompt_messages(q: Question | str, tools: bool, system: bool = False) -> list[dict]:
    """The conversation before the first assistant turn (a question, or the user's text):
    with ``tools``, the system message declaring the calculator (tool_system_prompt());
    else an optional plain system message."""
    user = {"role": "user", "content": q if isinstance(q, str) else tool_arith_prompt(q.a, q.b, q.op)}
    if tools:
        return [{"role": "system", "content": tool_system_prompt()}, user]
    return ([{"role": "system", "content": DEFAULT_SYSTEM}] if system else []) + [user]


def tool_call_text(name: str, arguments: dict) -> str:
    """A tool call as Qwen2 writes one in its turn."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def first_call_result(text: str) -> str | None:
    """The calculator's answer to a turn's first tool call, an error text for a bad call,
    or None when the turn calls no tool (its text is then the final answer)."""
    match = _CALL.search(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
        if call.get("name") != "calculator":
            return f"error: unknown tool {call.get('name')!r}"
        return _calculate(str(call["arguments"]["expression"]))
    except (ValueError, KeyError, TypeError, SyntaxError, AttributeError, RecursionError) as exc:
        return f"error: {type(exc).__name__}"


# --- the template, rendered -----------------------------------------------------------

def render(messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None) -> str:
    """TEMPLATE rendered as transformers renders it (before any tokenizer exists)."""
    return _template().render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools)


_COMPILED = None


def _template():
    global _COMPILED
    if _COMPILED is None:
        from workers.tasks.prompts import compile_bounded

        _COMPILED = compile_bounded(TEMPLATE, chat=True)  # transformers' chat environment, its tojson
    return _COMPILED


def tool_system_prompt(tools: tuple = (CALCULATOR_SCHEMA,), system: str = DEFAULT_SYSTEM) -> str:
    """The system message's content when ``tools`` are offered: a spec's ``task.system_prompt``
    with it renders the same tokens as ``apply_chat_template(..., tools=tools)``."""
    return system + _TOOLS_HEAD + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + _TOOLS_TAIL


def observation_text(content: str) -> str:
    """What follows a generated turn that ended with <|im_end|> when the tool answers: the
    template's rendering of the tool message and the next generation prompt."""
    head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    before = render(head)
    after = render(head + [{"role": "tool", "content": content}], add_generation_prompt=True)
    assert after.startswith(before) and before.endswith("<|im_end|>\n")
    return "\n" + after[len(before):]


def episode_segments(q: Question, tools: bool, system: bool = False) -> list[tuple[str, bool]]:
    """(text, trained) per segment of the warm start's episode: the prompt, then each
    assistant turn (trained, ending with <|im_end|>) and each observation."""
    prompt = render(prompt_messages(q, tools, system), add_generation_prompt=True)
    if not tools:
        return [(prompt, False), (q.answer + "<|im_end|>", True)]
    call = tool_call_text("calculator", {"expression": q.expression})
    return [(prompt, False), (call + "<|im_end|>", True), (observation_text(q.answer), False),
            (q.answer + "<|im_end|>", True)]


# --- tokenizer ------------------------------------------------------------------------

def tokenizer_corpus(recipe: dict) -> list[str]:
    """Episodes with and without tools rendered by TEMPLATE and cut at the special tokens
    and the tool tags (which are added, not learned), plus the zoo's English-like sentences."""
    rng = random.Random(recipe["seed"] * 7919 + 17)
    cut = re.compile("|".join(re.escape(t) for t in (*zoo_data.CHATML.specials, *TOOL_TAGS)))
    lines = []
    for q in questions(recipe["corpus"]["episodes"], rng, recipe):
        text = "".join(t for t, _ in episode_segments(q, rng.random() < 0.5, rng.random() < 0.5))
        lines += [part for part in cut.split(text) if part]
    lines += zoo_data.english_sentences(recipe["corpus"]["prose"], seed=recipe["seed"] * 7919 + 29)
    rng.shuffle(lines)
    return lines


def build_tokenizer(recipe: dict):
    """The zoo's byte-level BPE trained on tokenizer_corpus, ChatML's specials first, the
    four tool tags added (not special), TEMPLATE as its chat template."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    fmt = zoo_data.CHATML
    core = zoo_tokenizers.train_bpe(tokenizer_corpus(recipe), fmt, recipe["vocab"])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, extra_special_tokens=[fmt.specials[1]],
                                        clean_up_tokenization_spaces=False, model_max_length=recipe["max_positions"],
                                        eos_token=fmt.end_of_turn, pad_token=fmt.pad)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def encode_episodes(tokenizer, episodes: list[list[tuple[str, bool]]], check: int = 64) -> list[tuple[list[int], list[int]]]:
    """(ids, label mask) per episode: each segment encoded on its own, as the engine builds
    an episode. The first ``check`` episodes are checked equal to the whole conversation's
    encoding. A segment is encoded piece by piece between the added tokens (as the
    tokenizer itself splits a text first), each distinct piece once: the long system
    message is shared by most episodes."""
    added = {t: tokenizer.convert_tokens_to_ids(t) for t in (*zoo_data.CHATML.specials, *TOOL_TAGS)}
    split = re.compile("(" + "|".join(re.escape(t) for t in added) + ")")
    distinct = sorted({part for segments in episodes for text, _ in segments for part in split.split(text)}
                      - set(added) - {""})
    pieces = dict(zip(distinct, tokenizer(distinct, add_special_tokens=False)["input_ids"] if distinct else []))

    def encode(text: str) -> list[int]:
        ids: list[int] = []
        for part in split.split(text):
            if part:
                ids += [added[part]] if part in added else pieces[part]
        return ids

    out = []
    for n, segments in enumerate(episodes):
        ids, mask = [], []
        for text, trained in segments:
            seg = encode(text)
            ids += seg
            mask += [int(trained)] * len(seg)
        if n < check and tokenizer.encode("".join(t for t, _ in segments), add_special_tokens=False) != ids:
            raise RuntimeError("an episode's turn-by-turn ids differ from its whole encoding: the tokenizer merges "
                               "across a turn boundary")
        out.append((ids, mask))
    return out


# --- warm start -----------------------------------------------------------------------

def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int):
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id)
    att = torch.zeros((len(examples), width), dtype=torch.long)
    lab = torch.full((len(examples), width), -100)
    for i, (seq, mask) in enumerate(examples):
        t = torch.tensor(seq)
        ids[i, : len(seq)] = t
        att[i, : len(seq)] = 1
        lab[i, : len(seq)] = torch.where(torch.tensor(mask, dtype=torch.bool), t, torch.tensor(-100))
    return ids, att, lab


def _stop_ids(tokenizer) -> list[int]:
    return zoo_tokenizers.stop_ids(tokenizer, "qwen2")


def episode_accuracy(model, tokenizer, qs: list, tools: bool, system: bool = False, details: bool = False):
    """Greedy accuracy of episodes of at most two turns, run with HF generation: a turn with
    a tool call gets the calculator's answer and a second turn; the episode's last turn is
    right when its last number is the answer. ``qs``: Questions, or dataset rows (``prompt``,
    ``answer``). ``details``: also the share of first turns that call the tool and the texts
    of the first episode."""
    from workers.tasks.builtin_rewards import numeric_match

    stop, pad = _stop_ids(tokenizer), tokenizer.pad_token_id
    answers = [q.answer if isinstance(q, Question) else str(q["answer"]) for q in qs]
    qs = [q if isinstance(q, Question) else q["prompt"] for q in qs]
    prompts = [tokenizer.encode(render(prompt_messages(q, tools, system), add_generation_prompt=True),
                                add_special_tokens=False) for q in qs]
    first = modelzoo.greedy_completions(model, prompts, stop, pad, max_new=40)
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in first]
    results = [first_call_result(t) for t in texts]
    again = [i for i, r in enumerate(results) if r is not None]
    finals = list(texts)
    if again:
        follow = [prompts[i] + first[i] + tokenizer.encode(observation_text(results[i]), add_special_tokens=False)
                  for i in again]
        for i, c in zip(again, modelzoo.greedy_completions(model, follow, stop, pad, max_new=16)):
            finals[i] = tokenizer.decode(c, skip_special_tokens=True)
    accuracy = sum(numeric_match("", f, a) for f, a in zip(finals, answers)) / max(1, len(qs))
    if not details:
        return accuracy
    return {"accuracy": accuracy, "tool_call_share": len(again) / max(1, len(qs)),
            "example": {"first_turn": texts[0] if texts else "", "final": finals[0] if finals else ""}}


def held_out_questions(recipe: dict) -> list[Question]:
    return questions(recipe["held_out"], random.Random(recipe["seed"] * 1000 + 99), recipe)


def dev_questions(recipe: dict) -> list[Question]:
    return questions(recipe["dev"], random.Random(recipe["seed"] * 1000 + 98), recipe)


def _sft(model, tokenizer, recipe: dict, progress: bool) -> dict:
    held_out, dev = held_out_questions(recipe), dev_questions(recipe)
    rng = random.Random(recipe["seed"] * 1000 + 1)
    qs = questions(recipe["steps"] * recipe["batch"], rng, recipe, frozenset(held_out + dev))
    examples = encode_episodes(tokenizer, [episode_segments(q, rng.random() < recipe["tool_share"],
                                                            rng.random() < recipe["system_share"]) for q in qs])
    done, loss, dev_accuracy, seconds = modelzoo.sft_loop(
        model, tokenizer, examples, recipe, f"{NAME} warm start (SFT)",
        lambda: episode_accuracy(model, tokenizer, dev, tools=True), progress, batch_of=_batch)
    with_tools = episode_accuracy(model, tokenizer, held_out, tools=True, details=True)
    without = episode_accuracy(model, tokenizer, held_out, tools=False, details=True)
    return {"sft_steps": done, "final_loss": round(float(loss.detach()), 4), "sft_seconds": round(seconds, 1),
            "dev_accuracy": dev_accuracy, "held_out_accuracy": with_tools["accuracy"],
            "held_out_accuracy_no_tools": without["accuracy"], "held_out_tool_call_share": with_tools["tool_call_share"],
            "held_out_tool_call_share_no_tools": without["tool_call_share"], "held_out_size": len(held_out),
            "example": with_tools["example"]}


def build_tool_model(out_dir, *, steps: int | None = None, seed: int = 0, progress: bool = False) -> Path:
    """Train the tokenizer, build and warm-start the model, write a complete HF folder to
    ``out_dir`` with ``fluxrl_zoo.json`` (recipe, held-out accuracy with and without the
    tool, weights checksum). Single-threaded and deterministic in ``seed``."""
    recipe = tool_recipe(steps, seed)
    out, manifest = modelzoo.build_folder(recipe, out_dir, "qwen2", build_tokenizer, _sft, progress, name=NAME)
    logger.info("%s: %s params, %d SFT steps in %.1f s, held-out greedy accuracy %.1f%% with the calculator, "
                "%.1f%% without -> %s", NAME, f"{manifest['params']:,}", manifest["sft_steps"],
                manifest["sft_seconds"], 100 * manifest["held_out_accuracy"],
                100 * manifest["held_out_accuracy_no_tools"], out)
    return out


def shipped_tool_model(recipe: dict) -> Path | None:
    """The warm start shipped with the project (``workers/assets/zoo-qwen2-tools``), if it was
    built from ``recipe`` (modelzoo.shipped_model)."""
    return modelzoo.shipped_model(NAME, recipe)


def ensure_tool_model(root: str | os.PathLike | None = None, *, steps: int | None = None, seed: int = 0,
                      progress: bool = False) -> Path:
    """The folder of the tool model under ``$FLUXRL_MODEL_CACHE`` (or ``root``) as
    ``zoo-qwen2-tools-<recipe id>``: the shipped warm start for the default recipe, else built
    once (a few CPU minutes; modelzoo.ensure_built)."""
    return modelzoo.ensure_built(NAME, tool_recipe(steps, seed), root,
                                 lambda staging: build_tool_model(staging, steps=steps, seed=seed, progress=progress))
