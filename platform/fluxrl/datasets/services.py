"""Datasets: validate uploads (JSONL/CSV) or generate built-in data, and store each as
an immutable, checksummed JSONL version under FLUXRL_DATA_DIR/datasets/."""
from __future__ import annotations

import csv
import hashlib
import inspect
import io
import itertools
import json
import math
import os
import tempfile
from pathlib import Path

from django.conf import settings
from django.db import transaction

from fluxrl.errors import NotFound, TooLarge, field_error
from fluxrl.quotas.services import check_storage
from fluxrl.validation import contains_nul, safe_upload_name
from fluxrl.versioned import check_name, find_version, next_version_number
from workers.tasks.datasets import GENERATORS, DatasetError, check_messages, generate

from .models import Dataset, DatasetVersion

MAX_REPORTED_ROW_ERRORS = 5
MAX_GENERATED_ROWS = 200_000
FORMAT_BY_SUFFIX = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv"}


class RowProblem(ValueError):
    pass


# --- reading uploads -----------------------------------------------------------------


def detect_format(file_name: str, explicit: str | None) -> str:
    fmt = explicit or FORMAT_BY_SUFFIX.get(Path(file_name).suffix.lower())
    if fmt not in ("jsonl", "csv"):
        raise field_error("format", "cannot tell the format from the file name: give format=jsonl or format=csv")
    return fmt


# What browsers and clients send for .jsonl/.csv files; anything else (images, archives,
# PDFs, ...) is refused before it is read.
TEXT_CONTENT_TYPES = {"application/json", "application/x-ndjson", "application/ndjson", "application/jsonl",
                      "application/x-jsonlines", "application/jsonlines", "application/csv", "application/x-csv",
                      "application/vnd.ms-excel", "application/octet-stream", ""}


def check_content_type(content_type: str | None) -> None:
    kind = str(content_type or "").split(";")[0].strip().lower()
    if not (kind.startswith("text/") or kind in TEXT_CONTENT_TYPES):
        raise field_error("file", f"content type '{kind}' is not a text file: upload JSONL or CSV as UTF-8 text")


def decode_utf8(data: bytes) -> str:
    nul = data.find(b"\x00")
    if nul >= 0:  # UTF-8 text never has one; binaries and UTF-16 text do
        line = data.count(b"\n", 0, nul) + 1
        raise field_error("file", f"line {line}: a NUL byte: this is a binary file (or UTF-16), not UTF-8 text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise field_error("file", f"line {line}: not UTF-8 text (byte {exc.start})") from None


def strict_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:20]} is out of range")
    return value


def parse_json_line(line: str):
    """One JSONL row; NaN, Infinity and numbers that overflow are errors (the API
    could not send them back as JSON), and so is nesting too deep to parse."""
    try:
        return json.loads(line, parse_constant=strict_constant, parse_float=finite_float)
    except json.JSONDecodeError as exc:
        return RowProblem(f"not valid JSON ({exc.msg}, column {exc.colno})")
    except ValueError as exc:
        return RowProblem(f"not valid JSON ({exc})")
    except RecursionError:
        return RowProblem("not valid JSON (nested too deeply)")


def raw_rows(text: str, fmt: str):
    """Yield (line number, parsed object or RowProblem)."""
    if fmt == "jsonl":
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                yield number, parse_json_line(line)
        return
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        if not reader.fieldnames or len(set(reader.fieldnames)) != len(reader.fieldnames):
            raise field_error("file", "line 1: the CSV header must name each column once")
        for row in reader:
            if None in row or None in row.values():
                yield reader.line_num, RowProblem(f"the number of cells differs from the header's {len(reader.fieldnames)}")
            else:
                yield reader.line_num, row
    except csv.Error as exc:  # e.g. a cell over the csv module's field size limit: the reader cannot go on
        raise field_error("file", f"line {reader.line_num + 1}: not readable as CSV ({exc})") from None


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


def parse_upload(data: bytes, fmt: str, prompt_field: str, answer_field: str) -> list[dict]:
    if not data.strip():
        raise field_error("file", "the file is empty")
    rows, problems = [], []
    for number, obj in raw_rows(decode_utf8(data), fmt):
        try:
            if isinstance(obj, RowProblem):
                raise obj
            rows.append(normalize_row(obj, prompt_field, answer_field))
        except RowProblem as exc:
            problems.append(f"line {number}: {exc}")
    if problems:
        more = len(problems) - MAX_REPORTED_ROW_ERRORS
        text = "; ".join(problems[:MAX_REPORTED_ROW_ERRORS]) + (f"; and {more} more bad lines" if more > 0 else "")
        raise field_error("file", text)
    if not rows:
        raise field_error("file", "the file has no rows")
    return rows


# --- storing versions ------------------------------------------------------------------


def write_immutable(path: Path, body: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".upload-")
    with os.fdopen(fd, "wb") as fh:
        fh.write(body)
    os.chmod(tmp, 0o444)
    os.replace(tmp, path)  # readers never see a half-written file


@transaction.atomic
def add_version(team, user, name: str, rows: list[dict], description: str = "", **meta) -> DatasetVersion:
    """Store rows as the next version of the team's dataset `name` (created if new)."""
    check_name(name)
    body = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()
    check_storage(team, len(body), 1)  # the team's quota; locks the team until the version is stored
    dataset, _ = Dataset.objects.get_or_create(team=team, name=name, defaults={"created_by": user, "description": description})
    dataset = Dataset.objects.select_for_update().get(pk=dataset.pk)  # serializes version numbers
    number = next_version_number(dataset)
    sha256 = hashlib.sha256(body).hexdigest()
    relative = Path("datasets") / str(team.id) / str(dataset.id) / f"v{number}-{sha256[:12]}.jsonl"
    write_immutable(Path(settings.FLUXRL_DATA_DIR) / relative, body)
    return DatasetVersion.objects.create(
        dataset=dataset, version=number, file=str(relative), sha256=sha256, size_bytes=len(body),
        row_count=len(rows), columns=list(dict.fromkeys(key for row in rows for key in row)),
        created_by=user, **meta,
    )


def upload_version(team, user, name: str, upload, *, prompt_field="prompt", answer_field="answer",
                   fmt: str | None = None, description: str = "") -> DatasetVersion:
    """Validate an uploaded JSONL/CSV file (a Django UploadedFile) and store it as a new version."""
    check_name(name)
    limit = settings.FLUXRL_MAX_UPLOAD_BYTES
    if upload.size > limit:
        raise TooLarge(f"The file is {upload.size} bytes; the limit is {limit} bytes.", fields={"file": "too large"})
    check_content_type(getattr(upload, "content_type", ""))
    fmt = detect_format(upload.name, fmt)
    rows = parse_upload(upload.read(), fmt, prompt_field, answer_field)
    return add_version(team, user, name, rows, description, source=fmt, source_name=safe_upload_name(upload.name),
                       source_fields={"prompt": prompt_field, "answer": answer_field})


def generator_catalog() -> list[dict]:
    catalog = []
    for name, fn in GENERATORS.items():
        params = {p.name: p.default for p in inspect.signature(fn).parameters.values() if p.name not in ("n", "seed")}
        catalog.append({"name": name, "description": inspect.getdoc(fn) or "", "params": params})
    return catalog


def generate_version(team, user, name: str, generator: str, n: int, seed: int = 0, params: dict | None = None,
                     description: str = "") -> DatasetVersion:
    """A version made by a built-in generator of workers.tasks.datasets (add, chain, countdown)."""
    check_name(name)
    if generator not in GENERATORS:
        raise field_error("generator", f"unknown generator '{generator}'; choose one of {sorted(GENERATORS)}")
    if not 1 <= n <= MAX_GENERATED_ROWS:
        raise field_error("n", f"must be between 1 and {MAX_GENERATED_ROWS}")
    params = params or {}
    try:
        rows = [normalize_row(row, "prompt", "answer") for row in generate(generator, n, seed=seed, **params)]
    except (TypeError, ValueError) as exc:
        raise field_error("params", str(exc)) from None
    return add_version(team, user, name, rows, description, source=DatasetVersion.Source.GENERATOR,
                       generator={"name": generator, "n": n, "seed": seed, "params": params})


# --- reading versions ------------------------------------------------------------------


def get_version(team, ref: str, field: str = "dataset") -> DatasetVersion:
    """The team's dataset version named by 'name@version' (or the newest for 'name')."""
    return find_version(DatasetVersion.objects.select_related("dataset"), "dataset", team, ref, field)


def read_rows(version: DatasetVersion, offset: int = 0, limit: int | None = None) -> list[dict]:
    try:
        with version.path.open(encoding="utf-8") as fh:
            lines = itertools.islice(fh, offset, None if limit is None else offset + limit)
            return [json.loads(line) for line in lines]
    except FileNotFoundError:
        raise NotFound(f"The stored file of {version} is missing.") from None

