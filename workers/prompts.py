"""Prompts as the model sees them: the model folder's own tokenizer turns a dataset row
into token ids and generated ids back into text, the same ids for vLLM, the trainer and
the reference model.

A row becomes the model's input in one of three ways (``task.prompt_format``):
- raw: the row's ``prompt`` (or ``task.prompt_template`` rendered over the row) as text;
- chat: a ``messages`` list, or the prompt as the user message with an optional
  ``system`` (row field or ``task.system_prompt``), rendered by the tokenizer's chat
  template with ``add_generation_prompt``;
- auto (default): chat when the row has ``messages`` or a system message, else raw.

Stop ids are every end-of-sequence id the model declares: ``generation_config.json``'s
``eos_token_id`` (often a list: an end-of-turn token and an end-of-text token) and the
tokenizer's own.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


class PromptError(ValueError):
    """A row, template or tokenizer that cannot make a prompt (bad input: exit code 2)."""


MAX_TEMPLATE_RESULT = 100_000  # characters (or items) one operation of a template may build


def _environment():
    """Jinja's sandbox (no Python internals), with ``*`` and ``**`` intercepted: Jinja folds
    constant expressions while compiling, so ``{{ 'a' * 10**10 }}`` would otherwise build
    a 10 GB string in whatever process validates the spec (the web process too)."""
    from jinja2 import StrictUndefined
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "**":
                if isinstance(right, (int, float)) and abs(right) > 64 and abs(left) > 1:
                    raise SecurityError("a power this large is not allowed in a prompt template")
                return left ** right
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_TEMPLATE_RESULT:
                    raise SecurityError(f"a template may not build more than {MAX_TEMPLATE_RESULT} characters at once")
            return left * right

    return BoundedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True)


def compile_template(text: str):
    """A Jinja template over row fields, in the bounded sandbox above: undefined fields
    are errors, not empty strings."""
    from jinja2 import TemplateSyntaxError

    try:
        return _environment().from_string(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"line {exc.lineno}: {exc.message}") from None


def load_tokenizer(model_path: str):
    """The folder's tokenizer, or a PromptError saying what is missing."""
    from transformers import AutoTokenizer

    if os.path.isdir(model_path) and not any(os.path.isfile(os.path.join(model_path, f)) for f in TOKENIZER_FILES):
        raise PromptError(f"model.path {model_path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                          "save it next to the weights with tokenizer.save_pretrained(folder)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds here
        raise PromptError(f"model.path {model_path!r}: its tokenizer does not load: {type(exc).__name__}: {exc}") from None
    return _as_saved(tokenizer, model_path)


_PROBE = "Hello, World! 12+7=19 3.5 x\n  \u00e9\u4e2d <b>"


def _as_saved(tokenizer, model_path: str):
    """transformers 5 rebuilds a known family's tokenizer from its vocabulary, with that
    family's pre-tokenizer (a Qwen2 config gets Qwen2's byte-level split), ignoring the
    pipeline in tokenizer.json. For a checkpoint whose tokenizer.json says otherwise that
    silently changes the ids: when the two disagree on a probe, the file wins."""
    path = os.path.join(model_path, "tokenizer.json")
    if not os.path.isfile(path):
        return tokenizer
    from tokenizers import Tokenizer

    saved = Tokenizer.from_file(path)
    if tokenizer.encode(_PROBE, add_special_tokens=False) == saved.encode(_PROBE, add_special_tokens=False).ids:
        return tokenizer
    from transformers import PreTrainedTokenizerFast

    logger.warning("%s: %s encodes differently from tokenizer.json; using tokenizer.json as saved",
                   model_path, type(tokenizer).__name__)
    return PreTrainedTokenizerFast.from_pretrained(model_path)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def stop_token_ids(model_path: str, tokenizer) -> list[int]:
    """Every end-of-sequence id: generation_config.json's, then the tokenizer's (in order, once)."""
    ids: list[int] = []
    path = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            ids += _ids(json.load(fh).get("eos_token_id"))
    ids += _ids(tokenizer.eos_token_id)
    return list(dict.fromkeys(ids))


def row_is_chat(row: dict, fmt: str, system_prompt: Optional[str]) -> bool:
    if fmt != "auto":
        return fmt == "chat"
    return isinstance(row.get("messages"), list) or bool(row.get("system")) or bool(system_prompt)


class PromptRenderer:
    """Rows → prompt text → token ids (cached per prompt), and generated ids → text."""

    def __init__(self, tokenizer, fmt: str = "auto", template: Optional[str] = None,
                 system_prompt: Optional[str] = None):
        self.tokenizer = tokenizer
        self.format = fmt
        self.template = compile_template(template) if template else None
        self.system_prompt = system_prompt
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def for_task(cls, tokenizer, task) -> "PromptRenderer":
        return cls(tokenizer, task.prompt_format, task.prompt_template, task.system_prompt)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def is_chat(self, row: dict) -> bool:
        return row_is_chat(row, self.format, self.system_prompt)

    def _user_text(self, row: dict) -> str:
        if self.template is None:
            return row["prompt"]
        try:
            return self.template.render(**row)
        except Exception as exc:  # noqa: BLE001 - an undefined field, a sandbox refusal
            raise PromptError(f"task.prompt_template failed on a row: {type(exc).__name__}: {exc}") from None

    def messages(self, row: dict) -> list[dict]:
        if isinstance(row.get("messages"), list):
            return row["messages"]
        system = row.get("system") or self.system_prompt
        return ([{"role": "system", "content": str(system)}] if system else []) + \
            [{"role": "user", "content": self._user_text(row)}]

    def text(self, row: dict) -> str:
        """The prompt exactly as the tokenizer encodes it."""
        if not self.is_chat(row):
            return self._user_text(row)
        if not self.has_chat_template:
            raise PromptError("a chat row (messages or a system message) needs a chat template, and this model's "
                              "tokenizer has none: set task.prompt_format: raw with a task.prompt_template, or add "
                              "chat_template to tokenizer_config.json")
        try:
            return self.tokenizer.apply_chat_template(self.messages(row), add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - a template that raises on these messages
            raise PromptError(f"the chat template failed on a row: {type(exc).__name__}: {exc}") from None

    def ids(self, row: dict) -> list[int]:
        key = json.dumps([row.get("messages"), row.get("system"), row.get("prompt")] if self.template is None
                         else row, sort_keys=True, default=str)
        ids = self._cache.get(key)
        if ids is None:
            # A chat template writes its own special tokens (BOS included); raw text gets
            # the tokenizer's (a Llama BOS), as the model saw text in pre-training.
            ids = self.tokenizer.encode(self.text(row), add_special_tokens=not self.is_chat(row))
            if not ids:
                raise PromptError(f"a row's prompt encodes to no tokens: {row.get('prompt')!r:.80}")
            self._cache[key] = ids
        return ids

    def decode(self, ids: list[int]) -> str:
        """The completion text that is scored: the generated ids, special tokens left out."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def pieces(self, ids: list[int], context: int = 6) -> list[str]:
        """Each token's own text, at real token boundaries (special tokens shown): the
        difference of decoding with and without it, over a few tokens of context so
        byte-level pieces of one character and SentencePiece's leading spaces come out right."""
        out = []
        for i in range(len(ids)):
            start = max(0, i - context)
            before = self.tokenizer.decode(ids[start:i], skip_special_tokens=False)
            after = self.tokenizer.decode(ids[start:i + 1], skip_special_tokens=False)
            out.append(after[len(before):] if after.startswith(before) else self.tokenizer.decode([ids[i]]))
        return out
