"""The child process of workers.tasks.template_child: reads a header and rows (JSON lines)
on stdin, compiles and renders the user's templates (or generates a ``gen:`` dataset's
rows) under the limits the parent passes in argv, and answers one JSON line per row. Run
only as ``python -I -c <template_child._BOOT> ROOT MEMORY_MB CPU_S``."""
from __future__ import annotations

import json
import os
import signal
import sys

from workers.tasks.template_child import CHAT_TEMPLATE, PROMPT_TEMPLATE


class _RowTimeout(BaseException):
    """Raised by SIGALRM inside a render: a BaseException, so no template-level handler catches it."""


def _answer(**reply) -> None:
    sys.stdout.write(json.dumps(reply, default=str) + "\n")


def _fail(message: str, source: str | None = None, row: int | None = None) -> None:
    _answer(error=message[:2000], source=source, row=row)
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    import resource

    memory = int(sys.argv[2]) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu = int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL
    header = json.loads(sys.stdin.readline())
    per_row, budget_text = header["row_s"], header["budget"]

    def alarm(*_):
        raise _RowTimeout()

    signal.signal(signal.SIGALRM, alarm)

    def bounded(source, row, what, fn, *args, **kwargs):
        where = f" on row {row + 1}" if row is not None else ""
        signal.setitimer(signal.ITIMER_REAL, per_row)
        try:
            return fn(*args, **kwargs)
        except _RowTimeout:
            _fail(f"{what} took over {per_row:g} s{where} (the budget is {budget_text})", source, row)
        except MemoryError:
            _fail(f"{what} ran out of memory{where} (the budget is {budget_text})", source, row)
        except Exception as exc:  # noqa: BLE001 - the template's own error: reported, not raised
            # A sandbox refusal (a size or range over its bound) is the budget too.
            refused = type(exc).__name__ in ("SecurityError", "OverflowError") or "would build more" in str(exc)
            bound = f" (the budget is {budget_text})" if refused else ""
            if what == "compiling":
                detail = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                _fail(f"does not compile: {detail}{bound}" if not detail.startswith("line ") else detail + bound,
                      source, row)
            _fail(f"failed{where}: {type(exc).__name__}: {exc}{bound}", source, row)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    if header["op"] == "generate":
        from workers.tasks.datasets import load_rows

        rows, _ = bounded("dataset", None, "generating the rows", load_rows, header["dataset"], size=header["n"],
                          eval_size=0, seed=header["seed"])
        for row in rows[: header["n"]]:
            _answer(row=row)
        return

    from workers.tasks import prompts

    templates = {}
    for source, key, chat in ((PROMPT_TEMPLATE, "prompt_template", False), (CHAT_TEMPLATE, "chat_template", True)):
        if header.get(key):
            templates[source] = bounded(source, None, "compiling", prompts.compile_bounded, header[key], chat=chat)
    if header["op"] == "check":
        _answer(ok=True)
        return
    fmt, system, special = header["prompt_format"], header["system_prompt"], header["special_tokens"]
    total = 0
    for index, line in enumerate(sys.stdin):
        row = json.loads(line)
        prompt = templates.get(PROMPT_TEMPLATE)
        if not prompts.row_is_chat(row, fmt, system):
            text = bounded(PROMPT_TEMPLATE, index, "rendering", prompt.render, **row) if prompt else str(row["prompt"])
            source = PROMPT_TEMPLATE
        else:
            if isinstance(row.get("messages"), list):
                messages = row["messages"]
            else:
                user = bounded(PROMPT_TEMPLATE, index, "rendering", prompt.render, **row) if prompt else row["prompt"]
                sys_text = row.get("system") or system
                messages = ([{"role": "system", "content": str(sys_text)}] if sys_text else []) + \
                    [{"role": "user", "content": user}]
            chat = templates.get(CHAT_TEMPLATE)
            if chat is None:
                _fail("a chat row (messages or a system message) needs a chat template, and this model's tokenizer "
                      "has none", CHAT_TEMPLATE, index)
            # What transformers' apply_chat_template passes: the tokenizer's special tokens, then these.
            text = bounded(CHAT_TEMPLATE, index, "rendering", chat.render,
                           **{**special, "messages": messages, "tools": None, "documents": None,
                              "add_generation_prompt": True})
            source = CHAT_TEMPLATE
        total += len(text)
        if len(text) > header["max_chars"]:
            _fail(f"the prompt it renders on row {index + 1} is over {header['max_chars']} characters", source, index)
        if total > header["max_total"]:
            _fail(f"the prompts it renders are over {header['max_total']} characters in all", source, index)
        _answer(text=text)
