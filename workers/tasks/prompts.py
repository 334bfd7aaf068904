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
    """A row, template or tokenizer that cannot make a prompt (bad input: exit code 2).
    source: the template at fault (template_child.PROMPT_TEMPLATE or CHAT_TEMPLATE), if one is."""

    def __init__(self, message: str, source: Optional[str] = None):
        super().__init__(message)
        self.source = source


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

    def noted(check):
        def checked(*args):
            try:
                check(*args)
            except Exception as exc:
                refusals.append(str(exc))
                raise
        return checked

    _too_big, _check_percent = noted(_check_size), noted(_check_percent_spec)

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


def _environment(chat: bool = False):
    """Jinja's immutable sandbox (no Python internals), with every operation that can build
    far more than it is given bounded at MAX_TEMPLATE_RESULT: ``*`` and ``**``, ``%`` and
    str.format widths, the width filters (center, indent, format, batch, slice, tojson,
    join, replace, sum) and str's ljust/rjust/center/zfill/expandtabs; no lipsum. Jinja
    folds constant expressions while compiling, so ``{{ 'x'|center(10**8) }}`` would
    otherwise build 100 MB in whatever process compiles the template. CPU time and the
    total size (a loop building many bounded pieces) are not bounded here: templates are
    compiled and rendered only in a child process with limits (workers.tasks.template_child).
    chat: the environment transformers' apply_chat_template renders a chat template in
    (trim_blocks, lstrip_blocks, loop controls, {% generation %}, undefined fields empty,
    its tojson, raise_exception and strftime_now), with the same bounds."""
    from jinja2 import StrictUndefined, Undefined, nodes
    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.ext import Extension, loopcontrols
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

    if not chat:
        env = BoundedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True)
    else:
        class Generation(Extension):
            """{% generation %}...{% endgeneration %}: transformers marks assistant text with it;
            rendered as its body (a prompt never asks for the assistant mask)."""
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.Scope(body).set_lineno(lineno)

        env = BoundedEnvironment(undefined=Undefined, trim_blocks=True, lstrip_blocks=True,
                                 extensions=[Generation, loopcontrols])
    env.refusals = []
    env.filters = _bounded_filters(env.filters, env.refusals)
    env.globals.pop("lipsum", None)  # lipsum(n=10**8): nothing a prompt needs
    if chat:
        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            _check_size("tojson's indent", _as_size(indent or 0))
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def raise_exception(message):
            raise TemplateError(message)

        def strftime_now(fmt):
            from datetime import datetime

            _check_size("strftime_now", len(str(fmt)) * 16)
            return datetime.now().strftime(fmt)

        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env


class DeferredTemplate:
    """What compile_template returns: a template checked in the child process and never
    compiled in this one; render() renders it over the given fields in a child too."""

    def __init__(self, text: str):
        self.text = text

    def render(self, **fields) -> str:
        from workers.tasks import template_child

        return template_child.render_rows([fields], prompt_template=self.text, prompt_format="raw")[0]


_template_checker = None


def check_templates_with(checker) -> None:
    """compile_template(text) calls checker(text) from now on instead of the default (a
    child process of workers.tasks.template_child): the web server sets one that also
    bounds how many children run at once (fluxrl/runs/apps.py)."""
    global _template_checker
    _template_checker = checker


_checked: dict[bytes, None] = {}  # sha256 of templates that compiled (only digests: nothing compiled is kept)
_CHECKED_MAX = 256


def _check_in_child(text: str) -> None:
    import hashlib

    from workers.tasks import template_child

    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    if digest in _checked:
        return
    try:
        template_child.check_template(text)
    except template_child.TemplateError as exc:
        raise ValueError(str(exc)) from None
    _checked[digest] = None
    while len(_checked) > _CHECKED_MAX:
        del _checked[next(iter(_checked))]


def compile_template(text: str) -> DeferredTemplate:
    """A Jinja template over row fields, checked (compiled) in the bounded child process:
    ValueError "line N: ..." for a bad one, or naming the budget. Nothing of it is compiled
    or kept compiled in this process (compile_bounded is the child's own compiler)."""
    (_template_checker or _check_in_child)(text)
    return DeferredTemplate(text)


def compile_bounded(text: str, chat: bool = False):
    """The template compiled in THIS process, in the bounded sandbox above: only for the
    template child (workers.tasks.template_child), which runs under a memory and time limit.
    chat: a model's chat template, in transformers' chat environment; otherwise a prompt
    template, where undefined fields are errors, not empty strings."""
    from jinja2 import TemplateSyntaxError

    env = _environment(chat)
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

    from workers.tasks.model_folder import UnsafeModelFolder, check_model_folder

    if os.path.isdir(model_path) and not any(os.path.isfile(os.path.join(model_path, f)) for f in TOKENIZER_FILES):
        raise PromptError(f"model.path {model_path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                          "save it next to the weights with tokenizer.save_pretrained(folder)")
    try:
        check_model_folder(model_path)
    except UnsafeModelFolder as exc:
        raise PromptError(str(exc)) from None
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


def _special_tokens(tokenizer) -> dict:
    """What apply_chat_template passes a chat template besides the messages (bos_token...)."""
    tokens = getattr(tokenizer, "special_tokens_map", None) or {}
    return {k: v if isinstance(v, (str, list)) else str(v) for k, v in tokens.items()}


def row_is_chat(row: dict, fmt: str, system_prompt: Optional[str]) -> bool:
    if fmt != "auto":
        return fmt == "chat"
    return isinstance(row.get("messages"), list) or bool(row.get("system")) or bool(system_prompt)


class PromptRenderer:
    """Rows → prompt text → token ids (cached per prompt), and generated ids → text.

    Templates (task.prompt_template, the tokenizer's chat template) are user input: they
    are compiled and rendered only in the bounded child of workers.tasks.template_child,
    never in this process. prepare(rows) renders a whole dataset in one child; text() and
    ids() of a row not prepared render it alone."""

    def __init__(self, tokenizer, fmt: str = "auto", template: Optional[str] = None,
                 system_prompt: Optional[str] = None, check: bool = True):
        self.tokenizer = tokenizer
        self.format = fmt
        if template and check:
            compile_template(template)  # checked now (in the child): a bad one is a spec error
        self.template = template or None
        self.system_prompt = system_prompt
        self._texts: dict[str, str] = {}
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def for_task(cls, tokenizer, task) -> "PromptRenderer":
        return cls(tokenizer, task.prompt_format, task.prompt_template, task.system_prompt)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def is_chat(self, row: dict) -> bool:
        return row_is_chat(row, self.format, self.system_prompt)

    def _key(self, row: dict) -> str:
        return json.dumps([row.get("messages"), row.get("system"), row.get("prompt")] if self.template is None
                          else row, sort_keys=True, default=str)

    def _chat_template(self) -> Optional[str]:
        """The tokenizer's chat template text as apply_chat_template picks it (a dict of named
        templates: its "default"); picking it compiles nothing."""
        if not self.has_chat_template:
            return None
        try:
            return self.tokenizer.get_chat_template()
        except Exception as exc:  # noqa: BLE001 - several named templates and no default
            raise PromptError(f"the chat template: {exc}") from None

    def prepare(self, rows: list[dict], deadline: Optional[float] = None) -> None:
        """Every row's prompt text rendered in one bounded child (rows needing no template
        skipped): PromptError naming the template, the row and the budget when it fails."""
        from workers.tasks import template_child

        todo: dict[str, dict] = {}
        for row in rows:
            if self.template is None and not self.is_chat(row):
                continue
            key = self._key(row)
            if key not in self._texts:
                todo.setdefault(key, row)
        if not todo:
            return
        chat_template = self._chat_template()
        if chat_template is None and any(self.is_chat(r) for r in todo.values()):
            raise PromptError("a chat row (messages or a system message) needs a chat template, and this model's "
                              "tokenizer has none: set task.prompt_format: raw with a task.prompt_template, or add "
                              "chat_template to tokenizer_config.json")
        try:
            texts = template_child.render_rows(
                list(todo.values()), prompt_template=self.template, chat_template=chat_template,
                special_tokens=_special_tokens(self.tokenizer), prompt_format=self.format,
                system_prompt=self.system_prompt, deadline=deadline)
        except template_child.TemplateDeadline:
            raise
        except template_child.TemplateError as exc:
            raise PromptError(f"{exc.source or 'the template'}: {exc}", source=exc.source) from None
        self._texts.update(zip(todo, texts))

    def text(self, row: dict) -> str:
        """The prompt exactly as the tokenizer encodes it."""
        if self.template is None and not self.is_chat(row):
            return row["prompt"]
        key = self._key(row)
        if key not in self._texts:
            self.prepare([row])
        return self._texts[key]

    def ids(self, row: dict) -> list[int]:
        key = self._key(row)
        ids = self._cache.get(key)
        if ids is None:
            # A chat template writes its own special tokens (BOS included); raw text gets
            # the tokenizer's (a Llama BOS), as the model saw text in pre-training.
            ids = self.tokenizer.encode(self.text(row), add_special_tokens=not self.is_chat(row))
            if not ids:
                raise PromptError(f"a row's prompt encodes to no tokens: {row.get('prompt')!r:.80}")
            self._cache[key] = ids  # the text stays too: reported samples show it (a child per lookup is slow)
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
