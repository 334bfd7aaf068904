"""Reading an uploaded dataset file: its format (from the name, the content type and the
first bytes), text checks, and its rows a bounded line at a time (JSONL and CSV). Nothing
here writes to the database or to storage (services.py does)."""
from __future__ import annotations

import csv
import io
import json
import math
from contextlib import contextmanager
from pathlib import Path

from django.conf import settings

from fluxrl.archives import ARCHIVE_SUFFIXES
from fluxrl.errors import field_error

from .rows import RowProblem, checked_rows, row_too_large

FORMAT_BY_SUFFIX = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv",
                    ".parquet": "parquet", ".pq": "parquet",
                    ".arrow": "arrow", ".arrows": "arrow", ".feather": "arrow", ".ipc": "arrow"}
FORMATS = ("jsonl", "csv", "parquet", "arrow", "hf_dataset")
TEXT_FORMATS = ("jsonl", "csv")
READ_CHUNK = 1 << 20  # what the web process reads of a stored or uploaded file at a time


def max_dataset_bytes() -> int:
    return settings.FLUXRL_MAX_DATASET_BYTES



def detect_format(file_name: str, explicit: str | None) -> str:
    lower = str(file_name).lower()
    fmt = explicit or FORMAT_BY_SUFFIX.get(Path(lower).suffix) or (
        "hf_dataset" if lower.endswith(ARCHIVE_SUFFIXES) else None)
    if fmt not in FORMATS:
        raise field_error("format", "cannot tell the format from the file name: give format= one of "
                          f"{', '.join(FORMATS)}")
    return fmt


# What browsers and clients send for .jsonl/.csv files; anything else (images, archives,
# PDFs, ...) is refused before it is read.
TEXT_CONTENT_TYPES = {"application/json", "application/x-ndjson", "application/ndjson", "application/jsonl",
                      "application/x-jsonlines", "application/jsonlines", "application/csv", "application/x-csv",
                      "application/vnd.ms-excel", "application/octet-stream", ""}


# The binary formats are recognized by their content (magic bytes, footers), and clients
# label them loosely (octet-stream, nothing, even text/plain): only media are refused unread.
NOT_DATA_CONTENT_TYPES = ("image/", "audio/", "video/", "font/", "application/pdf")


def check_content_type(content_type: str | None, fmt: str = "jsonl") -> None:
    kind = str(content_type or "").split(";")[0].strip().lower()
    if fmt in TEXT_FORMATS:
        if not (kind.startswith("text/") or kind in TEXT_CONTENT_TYPES):
            raise field_error("file", f"content type '{kind}' is not a text file: upload JSONL or CSV as UTF-8 text")
    elif kind.startswith(NOT_DATA_CONTENT_TYPES):
        raise field_error("file", f"content type '{kind}' does not fit the format {fmt}")


# The first bytes of the binary formats, to say what a file is when it is sent as text.
MAGIC = ((b"PAR1", "a Parquet file: name it .parquet or give format=parquet"),
         (b"ARROW1", "an Arrow IPC file: name it .arrow or give format=arrow"),
         (b"PK\x03\x04", "a zip archive: name it .zip (a save_to_disk folder) or give format=hf_dataset"))


def max_row_bytes() -> int:
    return settings.FLUXRL_DATASET_MAX_ROW_BYTES


def check_text_file(upload) -> None:
    """Refuse an upload that is empty, a binary format's file, has a NUL byte anywhere
    (binaries and UTF-16 text do; UTF-8 text never does) or is not UTF-8, before any line is
    parsed; read a chunk at a time."""
    upload.seek(0)
    blank, lines, offset, carry, bad = True, 0, 0, b"", None
    chunk = upload.read(READ_CHUNK)
    for magic, what in MAGIC:
        if chunk.startswith(magic):
            raise field_error("file", f"this is {what}, not UTF-8 text")
    while chunk:
        nul = chunk.find(b"\x00")
        if nul >= 0:
            line = lines + chunk.count(b"\n", 0, nul) + 1
            raise field_error("file", f"line {line}: a NUL byte: this is a binary file (or UTF-16), not UTF-8 text")
        if bad is None:
            bad, carry = _utf8_error(carry + chunk, offset - len(carry), lines - carry.count(b"\n"))
        lines += chunk.count(b"\n")
        offset += len(chunk)
        blank = blank and not chunk.strip()
        chunk = upload.read(READ_CHUNK)
    if carry and bad is None:  # the file ends inside a character
        bad = (lines - carry.count(b"\n") + 1, offset - len(carry))
    if bad:
        raise field_error("file", f"line {bad[0]}: not UTF-8 text (byte {bad[1]})")
    if blank:
        raise field_error("file", "the file is empty")
    upload.seek(0)


def _utf8_error(data: bytes, start: int, lines: int) -> tuple[tuple[int, int] | None, bytes]:
    """((line, byte) of the first byte of ``data`` that is not UTF-8, or None; the bytes of a
    character cut off at its end, to read with the next chunk). ``data`` starts at byte
    ``start`` of the file, after ``lines`` lines."""
    try:
        data.decode("utf-8")
        return None, b""
    except UnicodeDecodeError as exc:
        if exc.reason == "unexpected end of data" and len(data) - exc.start < 4:
            return None, data[exc.start:]
        return (lines + data.count(b"\n", 0, exc.start) + 1, start + exc.start), b""


@contextmanager
def _text(upload):
    """The upload as UTF-8 text (a leading byte order mark dropped), its lines ended by LF,
    CR LF or CR, the endings kept (the csv module needs them in quoted cells)."""
    upload.seek(0)
    text = io.TextIOWrapper(upload.file, encoding="utf-8-sig", newline="")
    try:
        yield text
    finally:
        text.detach()  # the upload's own file stays open


def text_lines(upload, row_limit: int):
    """(line number, the line with its ending, its bytes) of an uploaded UTF-8 file (checked
    by check_text_file), read one bounded line at a time: a line over the row limit is
    refused with no more of it read, so a huge line is never held whole or parsed."""
    with _text(upload) as text:
        number = 0
        while line := text.readline(row_limit + 3):  # the row, its "\r\n", and one more to tell it is over
            number += 1
            size = len(line.encode())
            ending = 2 if line.endswith("\r\n") else 1 if line.endswith(("\n", "\r")) else 0
            if size - ending > row_limit:
                raise row_too_large(f"line {number}", None, row_limit)
            yield number, line, size


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


def raw_rows(upload, fmt: str, row_limit: int):
    """Yield (label, parsed object or RowProblem) of a JSONL or CSV upload."""
    lines = text_lines(upload, row_limit)
    if fmt == "jsonl":
        for number, line, _ in lines:
            if line.strip():
                yield f"line {number}", parse_json_line(line)
        return
    record = {"bytes": 0, "first": 1}  # the CSV record being read: it may span lines (a quoted newline)

    def bounded():
        for number, line, size in lines:
            if not record["bytes"]:
                record["first"] = number
                if not line.strip("\r\n"):  # a blank line between records, which the reader skips
                    yield line
                    continue
            record["bytes"] += size
            if record["bytes"] > row_limit + 2:  # the record's line endings are not the row's
                raise row_too_large(f"the row from line {record['first']}", None, row_limit)
            yield line

    reader = csv.DictReader(bounded())
    try:
        if not reader.fieldnames or len(set(reader.fieldnames)) != len(reader.fieldnames):
            raise field_error("file", "line 1: the CSV header must name each column once")
        record["bytes"] = 0
        for row in reader:
            record["bytes"] = 0
            if None in row or None in row.values():
                yield f"line {reader.line_num}", RowProblem(
                    f"the number of cells differs from the header's {len(reader.fieldnames)}")
            else:
                yield f"line {reader.line_num}", row
    except csv.Error as exc:  # e.g. a cell over the csv module's field size limit: the reader cannot go on
        raise field_error("file", f"line {reader.line_num + 1}: not readable as CSV ({exc})") from None


def upload_rows(upload, fmt: str, prompt_field: str, answer_field: str):
    """(label, normalized row) of a JSONL or CSV upload, read a bounded line at a time; the
    first bad lines are reported together at the end (the caller drops what it staged)."""
    check_text_file(upload)
    return checked_rows(raw_rows(upload, fmt, max_row_bytes()), prompt_field, answer_field, noun="lines")
