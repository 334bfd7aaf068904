"""Prompt preview: a run spec's model and dataset -> one row's prompt exactly as the
engine renders it for the model (workers.tasks.prompts: format, template, system prompt, the
model folder's own tokenizer and chat template), with its token ids and their texts.

The model path is scoped as a run's is (check_model_path) and tokenizers are loaded once and
kept (a small LRU). Every template a user controls (the spec's task.prompt_template, the
model folder's chat template) is compiled and rendered only in the bounded child process of
workers.tasks.template_child (one memory and time budget, shared with the worker hosts; an
empty environment), never in the web process, and nothing compiled from one is kept here:
here and whenever a spec is validated in the web process (check_template, installed by
runs/apps.py). A gen: dataset's row is generated in that child too.

A preview takes its concurrency slot first (429 past FLUXRL_PROMPT_PREVIEW_MAX_CONCURRENT),
and stops at FLUXRL_PROMPT_PREVIEW_DEADLINE_S (503; loading a tokenizer, kept once loaded,
does not count): the child generating the row or rendering the templates is killed.
No user Python runs. Without the engine's libraries (a web-only install) the answer is
a 501 saying so."""
from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections import OrderedDict

from annotated_types import MaxLen
from django.conf import settings
from django.db import connection

from fluxrl.datasets import services as datasets
from fluxrl.errors import DomainError, InvalidInput, NotFound, TooManyRequests, field_error
from workers.models.preflight import ModelCheckError, resolve_model_path
from workers.tasks import template_child
from workers.tasks.prompts import TOKENIZER_FILES, PromptError, PromptRenderer, load_tokenizer, row_is_chat
from workers.spec import SpecError, TaskSpec, validate_spec
from workers.tasks.datasets import GENERATORS, DatasetError, check_messages
from workers.tasks.template_child import CHAT_TEMPLATE, TemplateDeadline, TemplateError

from .engine_inputs import MODEL_FIELD, check_model_path
from .services import load_spec_text, spec_errors

PREVIEW_MAX_TOKENS = 4096  # token ids and texts returned (token_count counts them all)
MAX_PROMPT_CHARS = template_child.MAX_PROMPT_CHARS
TOKENIZER_CACHE_SIZE = 4
DATASET_FIELD = "spec.task.dataset"
FORMAT_FIELD = "spec.task.prompt_format"
TEMPLATE_FIELD = "spec.task.prompt_template"


class EngineUnavailable(DomainError):
    status, code = 501, "engine_unavailable"


class PreviewDeadline(DomainError):
    status, code = 503, "preview_deadline"


def deadline_passed(what: str) -> PreviewDeadline:
    limit = settings.FLUXRL_PROMPT_PREVIEW_DEADLINE_S
    return PreviewDeadline(f"The preview was stopped {what}: a preview may take {limit:g} s "
                           "(FLUXRL_PROMPT_PREVIEW_DEADLINE_S). Try a smaller dataset parameter or template.")


# --- the spec and the row --------------------------------------------------------------------


def preview_spec(spec_input) -> tuple:
    """(spec, prompt_template): the spec's model and task validated by workers.spec (errors
    named spec.<field>), all but task.prompt_template, which is only checked to be text of
    the allowed length here and compiled in the child process (render_template): Jinja
    folds constant expressions while compiling, so `{{ 'a' * 10**10 }}` would be built in
    this process. Only model and task matter here, so a spec still being written (no name
    yet, a bad learning rate) can be previewed."""
    if isinstance(spec_input, (str, bytes)):
        spec_input = load_spec_text(spec_input)
    if not isinstance(spec_input, dict):
        raise field_error("spec", "a run spec: a mapping, or YAML/JSON text")
    name = spec_input.get("name")
    partial = {"name": name if isinstance(name, str) and 0 < len(name) <= 200 else "preview",
               **{k: spec_input[k] for k in ("model", "task") if k in spec_input}}
    template = None
    if isinstance(partial.get("task"), dict) and "prompt_template" in partial["task"]:
        template = partial["task"]["prompt_template"]
        partial["task"] = {k: v for k, v in partial["task"].items() if k != "prompt_template"}
        limit = next((m.max_length for m in TaskSpec.model_fields["prompt_template"].metadata
                      if isinstance(m, MaxLen)), 20000)
        if template is not None and not isinstance(template, str):
            raise field_error(TEMPLATE_FIELD, "must be text")
        if template is not None and len(template) > limit:
            raise field_error(TEMPLATE_FIELD, f"at most {limit} characters")
    try:
        return validate_spec(partial), template
    except SpecError as exc:
        raise spec_errors(exc.errors) from None


def given_row(row, task) -> dict:
    """A row typed in by the user, read as load_rows reads a JSONL line: the prompt from
    task.prompt_field, or a chat row's last user message; the answer is not needed."""
    if not isinstance(row, dict):
        raise field_error("row", "a JSON object, e.g. {\"prompt\": \"12+7=\"} or {\"messages\": [...]}")
    out = {k: v for k, v in row.items() if k != task.prompt_field}
    if "messages" in row:
        try:
            out["prompt"] = check_messages(row["messages"], "row")
        except DatasetError as exc:
            raise field_error("row", str(exc).removeprefix("row: ")) from None
    if task.prompt_field in row:
        out["prompt"] = str(row[task.prompt_field])
    if "prompt" not in out:
        raise field_error("row", f"needs the prompt field {task.prompt_field!r} (task.prompt_field) "
                                 "or a chat 'messages' list")
    return out


def first_row(team, task, deadline: float | None = None) -> dict:
    """The first row of the spec's dataset: a generator's (gen:<name>[?k=v]) as the engine
    generates it (in the bounded child, stopped at the deadline), or the first stored row
    of one of the team's datasets (another team's is not found, as at submission)."""
    ref = task.dataset
    if ref.startswith("gen:"):
        if ref[4:].partition("?")[0] not in GENERATORS:
            raise field_error(DATASET_FIELD, f"unknown generator; choose one of {sorted(GENERATORS)}")
        try:
            return template_child.generate_rows(ref, 1, seed=task.seed, deadline=deadline)[0]
        except TemplateDeadline:
            raise deadline_passed("while generating the row") from None
        except TemplateError as exc:  # parameters it does not take or cannot use, or over the budget
            raise field_error(DATASET_FIELD, str(exc).removeprefix("generating the rows failed: ")) from None
    try:
        version = datasets.get_version(team, ref, field=DATASET_FIELD)
    except NotFound as exc:  # a dangling reference is a bad spec, not a missing URL
        raise InvalidInput(exc.message, fields=exc.fields) from None
    rows = datasets.read_rows(version, 0, 1)
    if not rows:
        raise field_error(DATASET_FIELD, f"{version} has no rows")
    return rows[0]


# --- the tokenizer ---------------------------------------------------------------------------

_tokenizers: OrderedDict = OrderedDict()  # (path, files' mtimes) -> (tokenizer, lock)
_tokenizers_lock = threading.Lock()


def _signature(path: str) -> tuple:
    """What makes a cached tokenizer stale: its folder's tokenizer files changing."""
    if not os.path.isdir(path):
        return ()
    stats = []
    for name in (*TOKENIZER_FILES, "special_tokens_map.json", "chat_template.jinja", "chat_template.json"):
        try:
            st = os.stat(os.path.join(path, name))
        except OSError:
            continue
        stats.append((name, st.st_mtime_ns, st.st_size))
    return tuple(stats)


def engine_missing(exc: ImportError) -> EngineUnavailable:
    return EngineUnavailable(
        f"Prompt preview needs the engine's tokenizer libraries (transformers, tokenizers), and this server has "
        f"no {exc.name or 'engine'} module: it is a web-only install (FLUXRL_ENGINE=none). Install the engine "
        "here (scripts/setup.sh with FLUXRL_ENGINE=cpu), or preview with `python -m workers` on a worker host.")


def tokenizer_for(model_path: str):
    """(tokenizer, lock) for a model path as check_model_path returned it: builtin:tiny
    resolves to the tiny model's folder. Kept in an LRU of TOKENIZER_CACHE_SIZE; a
    tokenizer is used under its lock (a fast tokenizer's settings change per call)."""
    try:
        folder = resolve_model_path(model_path)  # builtin:tiny: imports torch (the engine's)
        key = (folder, _signature(folder))
        with _tokenizers_lock:
            if key in _tokenizers:
                _tokenizers.move_to_end(key)
                return _tokenizers[key]
        entry = (load_tokenizer(folder), threading.Lock())  # outside the lock: seconds for a large vocabulary
    except ImportError as exc:
        raise engine_missing(exc) from None
    except (ModelCheckError, PromptError) as exc:
        raise field_error(MODEL_FIELD, str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a damaged tokenizer file, and the like
        raise field_error(MODEL_FIELD, f"{model_path!r}: its tokenizer does not load: {type(exc).__name__}: {exc}") from None
    with _tokenizers_lock:
        for stale in [k for k in _tokenizers if k[0] == folder]:
            del _tokenizers[stale]
        _tokenizers[key] = entry
        while len(_tokenizers) > TOKENIZER_CACHE_SIZE:
            _tokenizers.popitem(last=False)
    return entry


# --- the user's templates, bounded ----------------------------------------------------------

TEMPLATE_CHILDREN_MAX = 4  # template children at once per web process (submissions and previews)
_children = threading.BoundedSemaphore(TEMPLATE_CHILDREN_MAX)


@contextlib.contextmanager
def _child_slot():
    """One of TEMPLATE_CHILDREN_MAX template children (workers.tasks.template_child), or a 429."""
    if not _children.acquire(timeout=template_child.TEMPLATE_TIMEOUT_S):
        raise TooManyRequests(f"{TEMPLATE_CHILDREN_MAX} prompt templates are already being checked: try again "
                              "shortly", retry_after_s=2)
    try:
        yield
    finally:
        _children.release()


_checked: OrderedDict = OrderedDict()  # sha256 of templates that compiled: a stored spec is validated again on display
_checked_lock = threading.Lock()
CHECKED_CACHE_SIZE = 256


def check_template(template: str) -> None:
    """workers.tasks.prompts.compile_template's checker in the web process (runs/apps.py): a spec's
    task.prompt_template is compiled in the bounded child, never here (Jinja allocates
    while folding constants at compile time). ValueError "line N: ..." for a bad one."""
    digest = hashlib.sha256(template.encode("utf-8", "surrogatepass")).digest()
    with _checked_lock:
        if digest in _checked:
            _checked.move_to_end(digest)
            return
    with _child_slot():
        try:
            template_child.check_template(template)
        except TemplateError as exc:
            raise ValueError(str(exc)) from None
    with _checked_lock:
        _checked[digest] = True
        while len(_checked) > CHECKED_CACHE_SIZE:
            _checked.popitem(last=False)


def render_template(template: str, row: dict, render: bool = True) -> str:
    """task.prompt_template compiled and rendered over the row as PromptRenderer does it, in
    the bounded child; render=False: only compiled. A 400 naming spec.task.prompt_template
    (and the budget, when it is the budget that stopped it) when it fails."""
    try:
        with _child_slot():
            if not render:
                template_child.check_template(template)
                return ""
            return template_child.render_rows([row], prompt_template=template, prompt_format="raw")[0]
    except TemplateError as exc:
        raise field_error(TEMPLATE_FIELD, str(exc)) from None


# --- the preview -----------------------------------------------------------------------------

_slots: dict[int, threading.BoundedSemaphore] = {}
_slots_lock = threading.Lock()


def _slot() -> threading.BoundedSemaphore:
    limit = settings.FLUXRL_PROMPT_PREVIEW_MAX_CONCURRENT
    with _slots_lock:
        return _slots.setdefault(limit, threading.BoundedSemaphore(limit))


def preview_prompt(team, spec_input, row: dict | None = None) -> dict:
    """{format, text, token_ids, tokens, token_count, truncated, row}: `row` (or the first
    row of the spec's dataset) as the engine renders it for the spec's model. token_ids and
    tokens (each token's own text, special tokens shown) stop after PREVIEW_MAX_TOKENS
    (truncated: true); token_count counts them all. 400s name the field at fault; 501
    without the engine's libraries; 429 past FLUXRL_PROMPT_PREVIEW_MAX_CONCURRENT previews
    at once in this process, before any work; 503 past FLUXRL_PROMPT_PREVIEW_DEADLINE_S
    (the generation or rendering under way is stopped). Call it from a thread, never an
    event loop."""
    slot = _slot()
    if not slot.acquire(blocking=False):  # first: nothing is parsed, generated or loaded without a slot
        raise TooManyRequests(f"{settings.FLUXRL_PROMPT_PREVIEW_MAX_CONCURRENT} prompt previews are already being "
                              "made: try again shortly", retry_after_s=2)
    try:
        deadline = time.monotonic() + settings.FLUXRL_PROMPT_PREVIEW_DEADLINE_S
        spec, template = preview_spec(spec_input)
        task = spec.task
        model_path = check_model_path(team, spec.model.path)
        row = given_row(row, task) if row is not None else first_row(team, task, deadline)
        if not connection.in_atomic_block:
            connection.close()  # no query below: back to the pool while a tokenizer loads
        return _render(model_path, task, template, row, deadline)
    finally:
        slot.release()


def _render(model_path: str, task, template: str | None, source: dict, deadline: float) -> dict:
    row = source
    chat = row_is_chat(row, task.prompt_format, task.system_prompt)
    loading = time.monotonic()
    tokenizer, lock = tokenizer_for(model_path)
    # Loading a tokenizer (once per folder, kept; the first one imports the engine's libraries)
    # cannot be stopped half-way and is not a user's work: the deadline bounds the rest.
    deadline += time.monotonic() - loading
    # The spec's template and the model's chat template, compiled and rendered in one bounded
    # child (check=False: the child reports a template that does not compile, by name).
    renderer = PromptRenderer(tokenizer, task.prompt_format, template, task.system_prompt, check=False)
    with lock:
        try:
            with _child_slot():
                renderer.prepare([row], deadline=deadline)
            text = renderer.text(row)
        except TemplateDeadline:
            raise deadline_passed("while rendering the templates") from None
        except PromptError as exc:  # a chat row without a chat template, or a template failing on it
            field = (MODEL_FIELD if exc.source == CHAT_TEMPLATE else TEMPLATE_FIELD if exc.source
                     else FORMAT_FIELD if not renderer.has_chat_template else MODEL_FIELD)
            raise field_error(field, str(exc)) from None
        if len(text) > MAX_PROMPT_CHARS:
            raise field_error("row", f"the prompt is {len(text)} characters; a preview shows up to {MAX_PROMPT_CHARS}")
        try:
            ids = renderer.ids(row)
        except PromptError as exc:
            raise field_error("row", str(exc)) from None
        shown = ids[:PREVIEW_MAX_TOKENS]
        pieces = renderer.pieces(shown)
    return {"format": "chat" if chat else "raw", "text": text, "token_ids": shown, "tokens": pieces,
            "token_count": len(ids), "truncated": len(ids) > len(shown), "row": source}
