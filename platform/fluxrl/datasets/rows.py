"""A dataset row as stored: normalized to {"prompt", "answer", ...} and encoded as one JSONL
line of at most FLUXRL_DATASET_MAX_ROW_BYTES. Imports no Django: the web process uses it
for JSONL/CSV uploads and generated rows, and the memory-capped child (convert.py) for
the columnar formats, so a row is judged the same way whichever process reads it."""
from __future__ import annotations

import json

from fluxrl.errors import InvalidInput, field_error
from fluxrl.validation import contains_nul
from workers.tasks.datasets import DatasetError, check_messages

MAX_REPORTED_ROW_ERRORS = 5


class RowProblem(ValueError):
    pass


def normalize_row(obj, prompt_field: str, answer_field: str) -> dict:
    """{"prompt", "answer", **extra}: the two named source fields renamed, answer as text."""
    if not isinstance(obj, dict):
        raise RowProblem("expected a JSON object")
    if contains_nul(obj):
        raise RowProblem("contains a NUL character")
    if prompt_field not in obj and "messages" in obj:  # a chat row: the last user message stands for its prompt
        try:
            obj = {**obj, prompt_field: check_messages(obj["messages"], "messages")}
        except DatasetError as exc:
            raise RowProblem(str(exc)) from None
    for field, canonical in ((prompt_field, "prompt"), (answer_field, "answer")):
        if field not in obj or obj[field] is None:
            raise RowProblem(f"missing field '{field}'" + (" (or a chat 'messages' list)" if field == prompt_field else ""))
        if field != canonical and canonical in obj:
            raise RowProblem(f"has a column '{canonical}' besides the {canonical} field '{field}'")
    prompt, answer = obj[prompt_field], obj[answer_field]
    if not isinstance(prompt, str) or not prompt:
        raise RowProblem(f"field '{prompt_field}' must be non-empty text")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise RowProblem(f"field '{answer_field}' must be text or a number")
    extra = {k: v for k, v in obj.items() if k not in (prompt_field, answer_field)}
    return {"prompt": prompt, "answer": str(answer), **extra}


def checked_rows(raw, prompt_field: str, answer_field: str, noun: str = "rows"):
    """(label, normalized row) of (label, raw row or RowProblem) pairs; the first bad rows
    are reported together at the end (the caller drops what it staged)."""
    problems = []
    for label, obj in raw:
        try:
            if isinstance(obj, RowProblem):
                raise obj
            row = normalize_row(obj, prompt_field, answer_field)
        except RowProblem as exc:
            problems.append(f"{label}: {exc}")
            continue
        if not problems:
            yield label, row
    if problems:
        more = len(problems) - MAX_REPORTED_ROW_ERRORS
        text = "; ".join(problems[:MAX_REPORTED_ROW_ERRORS]) + (f"; and {more} more bad {noun}" if more > 0 else "")
        raise field_error("file", text)


def row_too_large(label: str, size: int | None, limit: int, what: str = "as a JSON line") -> InvalidInput:
    """A row over the per-row cap: a 400 naming the row and the limit."""
    if size is None:  # refused before it was read whole
        return field_error("file", f"{label} is over the limit for one row, {limit} bytes "
                           "(FLUXRL_DATASET_MAX_ROW_BYTES)")
    return field_error("file", f"{label} is {size} bytes {what}; the limit for one row is {limit} bytes "
                       "(FLUXRL_DATASET_MAX_ROW_BYTES)")


def encode_row(row: dict, label: str, max_row_bytes: int) -> bytes:
    """The row's stored JSONL line (newline included), refused if the row is over the cap."""
    line = json.dumps(row, ensure_ascii=False, allow_nan=False).encode()
    if len(line) > max_row_bytes:
        raise row_too_large(label, len(line), max_row_bytes)
    return line + b"\n"
