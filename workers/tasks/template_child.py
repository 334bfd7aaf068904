"""Every template a user controls is compiled and rendered here, in a short-lived child
process with one budget, on the web host and on worker hosts alike: a spec's
``task.prompt_template``, a model folder's chat template (tokenizer_config.json's
``chat_template``, chat_template.jinja / chat_template.json) and a ``gen:`` dataset's rows
for the web's prompt preview. Nothing of a user's template is compiled, rendered or cached
in the calling process.

The budget (one for both sides; FLUXRL_TEMPLATE_MEMORY_MB, FLUXRL_TEMPLATE_TIMEOUT_S):
- memory: the child's address space (RLIMIT_AS) is TEMPLATE_MEMORY_MB, whatever the
  number of rows: rows are streamed through it one at a time;
- time: compiling, and rendering each row, may take TEMPLATE_TIMEOUT_S (a SIGALRM stops the
  render); a batch of n rows has TEMPLATE_TIMEOUT_S + n * TEMPLATE_ROW_S in all (wall
  clock and RLIMIT_CPU), so a whole dataset renders in one child, and a template slow on
  every row is stopped too;
- output: each rendered prompt at most MAX_PROMPT_CHARS; a batch at most
  MAX_PROMPT_CHARS + n * TEMPLATE_ROW_CHARS.
The child gets an empty environment (no DATABASE_URL, secrets...) and ``python -I``.
Templates render in the bounded sandbox of workers.tasks.prompts (the spec's with strict
undefined fields; a chat template as transformers' apply_chat_template renders it).

This module is the parent's side and imports nothing of FluxRL; the child runs
workers.tasks.template_worker."""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def _env_number(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        logger.warning("%s=%r is not a number; using %s", name, os.environ.get(name), default)
        return default
    return value if value > 0 else default


TEMPLATE_MEMORY_MB = int(_env_number("FLUXRL_TEMPLATE_MEMORY_MB", 512))
TEMPLATE_TIMEOUT_S = _env_number("FLUXRL_TEMPLATE_TIMEOUT_S", 3.0)
TEMPLATE_ROW_S = 0.02  # what each row of a batch adds to the batch's time (a chat template: ~0.1 ms a row)
TEMPLATE_ROW_CHARS = 50_000  # what each row of a batch adds to its output
MAX_PROMPT_CHARS = 1_000_000  # one rendered prompt
STARTUP_S = 2.0  # the child's interpreter and Jinja starting (seconds on a loaded 2-core host), not the template's
# What the child gets of the environment: nothing of its parent's (DATABASE_URL, secrets...).
CHILD_ENV = {"PATH": os.defpath, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}

PROMPT_TEMPLATE = "task.prompt_template"
CHAT_TEMPLATE = "the model's chat template"  # tokenizer_config.json chat_template, chat_template.jinja/.json


# The child's program (workers/tasks/template_worker.py), named here, not imported: the
# worker imports prompts, which imports this module.
_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from workers.tasks.template_worker import main; main()"


class TemplateError(ValueError):
    """A template that does not compile, fails on a row or goes over the budget. ``source``:
    PROMPT_TEMPLATE, CHAT_TEMPLATE or "dataset" (a generator); ``row``: the row's index."""

    def __init__(self, message: str, source: str | None = None, row: int | None = None):
        super().__init__(message)
        self.source, self.row = source, row


class TemplateDeadline(TemplateError):
    """The caller's own deadline (not the template's budget) came first."""


def budget() -> str:
    return f"{TEMPLATE_MEMORY_MB} MB and {TEMPLATE_TIMEOUT_S:g} s per render"


def _batch_seconds(n: int) -> float:
    return TEMPLATE_TIMEOUT_S + n * TEMPLATE_ROW_S


def _run(header: dict, rows: list | None = None, n: int = 1, deadline: float | None = None) -> list[dict]:
    """header (+ rows, one JSON line each) to a child; its answers, one dict per row (or one
    for a check). TemplateError when it fails or goes over the budget; TemplateDeadline
    when `deadline` (time.monotonic()) comes first. The child is killed either way."""
    limit = _batch_seconds(n)
    wait = limit + STARTUP_S
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TemplateDeadline("the deadline passed before it started")
        wait = min(wait, left)
    header = {**header, "row_s": TEMPLATE_TIMEOUT_S, "max_chars": MAX_PROMPT_CHARS,
              "max_total": MAX_PROMPT_CHARS + n * TEMPLATE_ROW_CHARS, "memory_mb": TEMPLATE_MEMORY_MB,
              "budget": budget()}
    lines = [json.dumps(header)] + [json.dumps(r, default=str) for r in rows or ()]
    root = str(Path(__file__).resolve().parents[2])
    cmd = [sys.executable, "-I", "-c", _BOOT, root, str(TEMPLATE_MEMORY_MB), str(math.ceil(limit) + 1)]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=CHILD_ENV, text=True, encoding="utf-8", errors="replace")
    try:
        out, err = child.communicate("\n".join(lines) + "\n", timeout=wait)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        if deadline is not None and time.monotonic() >= deadline - 0.01 and wait < limit + STARTUP_S:
            raise TemplateDeadline(f"stopped at the deadline, after {wait:.1f} s") from None
        raise TemplateError(f"took over {limit:g} s ({n} row(s); the budget is {budget()})") from None
    finally:
        if child.poll() is None:  # an exception above (KeyboardInterrupt): never leave it running
            child.kill()
            child.wait()
    answers = []
    for line in out.splitlines():
        try:
            answers.append(json.loads(line))
        except ValueError:
            break
    if answers and "error" in answers[-1]:
        last = answers[-1]
        raise TemplateError(last["error"], last.get("source"), last.get("row"))
    if child.returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # RLIMIT_CPU: the batch's time
        raise TemplateError(f"took over {limit:g} s of CPU ({n} row(s); the budget is {budget()})")
    if child.returncode != 0 or len(answers) < (len(rows) if rows is not None else 1):
        logger.info("template child exited %s: %s", child.returncode, err[-500:])
        raise TemplateError(f"ran out of memory or time (the budget is {budget()})")
    return answers


def check_template(template: str) -> None:
    """The template compiled (only) in the child; TemplateError "line N: ..." for a bad one."""
    _run({"op": "check", "prompt_template": template})


def render_rows(rows: list[dict], *, prompt_template: str | None = None, chat_template: str | None = None,
                special_tokens: dict | None = None, prompt_format: str = "auto", system_prompt: str | None = None,
                deadline: float | None = None) -> list[str]:
    """Each row's prompt text, as workers.tasks.prompts.PromptRenderer defines it, all rows
    in one child (see the budget above)."""
    if not rows:
        return []
    header = {"op": "render", "prompt_template": prompt_template, "chat_template": chat_template,
              "special_tokens": special_tokens or {}, "prompt_format": prompt_format, "system_prompt": system_prompt}
    return [a["text"] for a in _run(header, rows, n=len(rows), deadline=deadline)]


def generate_rows(dataset: str, n: int, seed: int = 0, deadline: float | None = None) -> list[dict]:
    """The first n rows of a gen:<name>[?k=v] dataset, generated in the child (a deadline
    that stops the work, not only the wait)."""
    return [a["row"] for a in _run({"op": "generate", "dataset": dataset, "n": n, "seed": seed}, None, n=n,
                                   deadline=deadline)]
