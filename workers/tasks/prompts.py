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
import re
from typing import Any, Optional

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


class PromptError(ValueError):
    """A row, template or tokenizer that cannot make a prompt (bad input: exit code 2)."""


MAX_TEMPLATE_RESULT = 100_000  # characters (or items) one operation of a template may build

# %-style conversion specs: width and precision (a number, or * taken from the arguments).
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\*|\d+)?(?:\.(\*|\d+))?")
_STR_WIDTH_METHODS = {"ljust": 0, "rjust": 0, "center": 0, "zfill": 0}  # name -> index of the width argument


def _check_size(what: str, size) -> None:
    from jinja2.exceptions import SecurityError

    if size > MAX_TEMPLATE_RESULT:
        raise SecurityError(f"{what} would build more than {MAX_TEMPLATE_RESULT} characters or items; a prompt "
                            "template may not")


def _as_size(value) -> int:
    """A width-like argument as a number (Jinja passes what the template wrote: ints, strings)."""
    if isinstance(value, bool):
        return 0
    if isinstance(value, (int, float)):
        return int(abs(value)) if abs(value) < 1e18 else 10 ** 18
    if isinstance(value, str):
        return int(value) if value.strip().isdigit() and len(value.strip()) < 19 else len(value)
    return 0


def _check_percent_spec(fmt, args) -> None:
    """`fmt % args` (the % operator, the format filter): no width or precision above the cap."""
    if not isinstance(fmt, str):
        return
    values = args if isinstance(args, tuple) else (args,)
    for width, precision in _PERCENT_SPEC.findall(fmt):
        for spec in (width, precision):
            if spec == "*":
                for value in values:
                    if isinstance(value, int):
                        _check_size("a %-format width", _as_size(value))
            elif spec:
                _check_size("a %-format width", _as_size(spec))


def _check_str_format(fmt: str) -> None:
    """str.format / format_map: no width above the cap, and no widths taken from arguments."""
    import string

    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # str.format raises the same error itself
    for _, _, spec, _ in fields:
        if spec and "{" in spec:
            from jinja2.exceptions import SecurityError

            raise SecurityError("nested format fields ({:{width}}) are not allowed in a prompt template")
        for number in re.findall(r"\d+", spec or ""):
            _check_size("a format width", _as_size(number))


def _bounded_filters(filters: dict, refusals: list) -> dict:
    """Jinja's filters whose output can be far larger than their input, refusing sizes
    above MAX_TEMPLATE_RESULT before building anything. They are what the compiler calls
    when it folds constants, so this also bounds compiling; Jinja drops an error raised
    while folding, so each refusal is also noted in refusals (compile_template reports it)."""
    base = dict(filters)

    def _too_big(what, size):
        try:
            _check_size(what, size)
        except Exception as exc:
            refusals.append(str(exc))
            raise

    def _check_percent(fmt, args):
        try:
            _check_percent_spec(fmt, args)
        except Exception as exc:
            refusals.append(str(exc))
            raise

    def center(value, width=80):
        _too_big("center", _as_size(width))
        return base["center"](value, width)

    def indent(s, width=4, first=False, blank=False):
        pad = len(width) if isinstance(width, str) else _as_size(width)
        _too_big("indent", pad * (str(s).count("\n") + 1))
        return base["indent"](s, width, first, blank)

    def format_(value, *args, **kwargs):
        _check_percent(value, args or kwargs)
        return base["format"](value, *args, **kwargs)

    def batch(value, linecount, fill_with=None):
        _too_big("batch", _as_size(linecount))
        return base["batch"](value, linecount, fill_with)

    def slice_(eval_ctx, value, slices, fill_with=None):
        _too_big("slice", _as_size(slices))
        return base["slice"](eval_ctx, value, slices, fill_with)

    def tojson(eval_ctx, value, indent=None):
        _too_big("tojson's indent", _as_size(indent or 0))
        return base["tojson"](eval_ctx, value, indent)

    def join(eval_ctx, value, d="", attribute=None):
        items = list(value)
        _too_big("join", len(str(d)) * max(0, len(items) - 1))
        return base["join"](eval_ctx, items, d, attribute)

    def replace(eval_ctx, s, old, new, count=None):
        s, old, new = str(s), str(old), str(new)
        hits = (s.count(old) if old else len(s) + 1) if count is None or count < 0 else _as_size(count)
        _too_big("replace", hits * max(0, len(new) - len(old)))
        return base["replace"](eval_ctx, s, old, new, count)

    def sum_(environment, iterable, attribute=None, start=0):
        items = list(iterable)
        if isinstance(start, (str, list, tuple)) and attribute is None:
            _too_big("sum", len(start) + sum(len(i) for i in items if isinstance(i, (str, list, tuple))))
        return base["sum"](environment, items, attribute, start)

    from jinja2.utils import pass_environment, pass_eval_context

    return {**filters, "center": center, "indent": indent, "format": format_, "batch": batch,
            "slice": pass_eval_context(slice_), "tojson": pass_eval_context(tojson), "join": pass_eval_context(join),
            "replace": pass_eval_context(replace), "sum": pass_environment(sum_)}


def _environment():
    """Jinja's immutable sandbox (no Python internals), with every operation that can build
    far more than it is given bounded at MAX_TEMPLATE_RESULT: ``*`` and ``**``, ``%`` and
    str.format widths, the width filters (center, indent, format, batch, slice, tojson,
    join, replace, sum) and str's ljust/rjust/center/zfill/expandtabs; no lipsum. Jinja
    folds constant expressions while compiling, so ``{{ 'x'|center(10**8) }}`` would
    otherwise build 100 MB in whatever process compiles the template. CPU time and the
    total size (a loop building many bounded pieces) are not bounded here: the web server
    compiles and renders templates only in a child process with limits (runs/preview.py)."""
    from jinja2 import StrictUndefined
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%"})

        def call_binop(self, context, operator, left, right):
            if operator == "**":
                if isinstance(right, (int, float)) and abs(right) > 64 and abs(left) > 1:
                    raise SecurityError("a power this large is not allowed in a prompt template")
                return left ** right
            if operator == "%":
                _check_percent_spec(left, right)
                return left % right
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_TEMPLATE_RESULT:
                    raise SecurityError(f"a template may not build more than {MAX_TEMPLATE_RESULT} characters at once")
            return left * right

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's own signature
            owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
            if isinstance(owner, str):
                if name in _STR_WIDTH_METHODS and args:
                    _check_size(f"str.{name}", _as_size(args[_STR_WIDTH_METHODS[name]]))
                elif name == "expandtabs":
                    _check_size("str.expandtabs", _as_size(args[0] if args else kwargs.get("tabsize", 8))
                             * (owner.count("\t") + 1))
                elif name == "join" and args:
                    items = list(args[0])
                    _check_size("str.join", len(owner) * max(0, len(items) - 1))
                    args = (items, *args[1:])
                elif name == "replace" and len(args) >= 2:
                    old, new = str(args[0]), str(args[1])
                    hits = owner.count(old) if old else len(owner) + 1
                    if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
                        hits = min(hits, args[2])
                    _check_size("str.replace", hits * max(0, len(new) - len(old)))
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            _check_str_format(value.__self__)
            return wrapped

    env = BoundedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True)
    env.refusals = []
    env.filters = _bounded_filters(env.filters, env.refusals)
    env.globals.pop("lipsum", None)  # lipsum(n=10**8): nothing a prompt needs
    return env


class DeferredTemplate:
    """What compile_template returns in a process that hands templates to a checker (the
    web server): the template was checked elsewhere and is never rendered here."""

    def __init__(self, text: str):
        self.text = text

    def render(self, *args, **kwargs):
        raise RuntimeError("prompt templates are rendered in a bounded child process here (runs/preview.py)")


_template_checker = None


def check_templates_with(checker) -> None:
    """From now on this process compiles no template itself: compile_template(text) calls
    checker(text) (which compiles it elsewhere, raising ValueError "line N: ..." for a bad
    one) and returns a DeferredTemplate. The web server sets this (fluxrl/runs/apps.py) so
    validating a spec never compiles user Jinja in the web process."""
    global _template_checker
    _template_checker = checker


def compile_template(text: str):
    """A Jinja template over row fields, in the bounded sandbox above: undefined fields
    are errors, not empty strings."""
    if _template_checker is not None:
        _template_checker(text)
        return DeferredTemplate(text)
    from jinja2 import TemplateSyntaxError

    env = _environment()
    try:
        template = env.from_string(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"line {exc.lineno}: {exc.message}") from None
    if env.refusals:  # a constant expression the bounded filters refused while folding
        raise ValueError(env.refusals[0])
    return template


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
