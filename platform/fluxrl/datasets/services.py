"""Datasets: validate uploads (JSONL, CSV, Parquet, Arrow, a save_to_disk folder as an
archive), import save_to_disk folders from the operator's import root, or generate built-in
data; store each as an immutable, checksummed JSONL version under FLUXRL_DATA_DIR/datasets/.

Import by path reads only FLUXRL_DATASET_IMPORT_ROOT/<team slug>/: a relative path of plain
names, resolved (symlinks included) and refused if it leads outside that folder; inside
the dataset folder no symlink is followed. A remote user uploads the same folder as a
.zip/.tar archive instead, read member by member by fluxrl.archives, as model folders are (no
absolute or climbing names, no links, sizes checked before bytes are read).

Parquet and Arrow files and save_to_disk folders are decoded a batch at a time (columnar.py)
in a memory-capped child process (convert.py), never in the web process: the child
normalizes the rows, applies the per-row and dataset caps and writes the version's JSONL
itself; the web process only counts and hashes that file in fixed-size chunks and renames
it into place, since one decoded row can be as large as the dataset limit. JSONL and CSV
uploads are read a bounded line at a time, a line over FLUXRL_DATASET_MAX_ROW_BYTES refused
before it is parsed, and rows are written to a staging file as they come, so no file sits
in memory whole. The team's storage quota is checked before anything is staged."""
from __future__ import annotations

import csv
import hashlib
import inspect
import io
import itertools
import json
import math
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from django.conf import settings
from django.db import transaction

from fluxrl.archives import ARCHIVE_SUFFIXES, clean_name, members, read_chunk
from fluxrl.errors import InvalidInput, NotFound, TooLarge, field_error
from fluxrl.quotas.services import check_storage
from fluxrl.validation import safe_upload_name
from fluxrl.versioned import check_name, find_version, next_version_number
from workers.tasks.datasets import GENERATORS, generate

from . import columnar, convert
from .models import Dataset, DatasetVersion
from .rows import RowProblem, checked_rows, encode_row, normalize_row, row_too_large

MAX_GENERATED_ROWS = 200_000
FORMAT_BY_SUFFIX = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv",
                    ".parquet": "parquet", ".pq": "parquet",
                    ".arrow": "arrow", ".arrows": "arrow", ".feather": "arrow", ".ipc": "arrow"}
MAX_ARCHIVE_FILES = 1024  # save_to_disk writes shards of 500 MB: a few files per split
FORMATS = ("jsonl", "csv", "parquet", "arrow", "hf_dataset")
TEXT_FORMATS = ("jsonl", "csv")
READ_CHUNK = 1 << 20  # what the web process reads of a stored or uploaded file at a time


# --- reading uploads -----------------------------------------------------------------


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


@contextmanager
def _reported_on(field: str):
    """Problems with the rows reported on ``field`` (an import request has no file)."""
    try:
        yield
    except InvalidInput as exc:
        if set(exc.fields) != {"file"}:
            raise
        raise field_error(field, exc.fields["file"]) from None


def max_dataset_bytes() -> int:
    return settings.FLUXRL_MAX_DATASET_BYTES


# --- save_to_disk folders: the import root and uploaded archives ---------------------------

IMPORT_PATH_PART = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._ -]*")  # no leading dot: no '..', nothing hidden
MAX_IMPORT_FOLDERS = 200
FOLDER_MARKERS = ("state.json", "dataset_dict.json")


def team_import_folder(team) -> Path:
    root = settings.FLUXRL_DATASET_IMPORT_ROOT
    if not root:
        raise field_error("path", "importing a folder by path is off on this server (FLUXRL_DATASET_IMPORT_ROOT is "
                          "not set): upload the folder as a .zip or .tar archive instead")
    return Path(root) / team.slug


def resolve_import_path(team, path: str) -> Path:
    """The folder ``path`` names under the team's import folder, symlinks resolved; refused
    if it is not a relative path of plain names or if it leads outside that folder."""
    team_root = team_import_folder(team)
    text = str(path or "").strip().strip("/")
    parts = [part for part in text.split("/") if part not in ("", ".")]
    if str(path or "").startswith(("/", "\\")) or "\\" in text or not parts or \
            not all(IMPORT_PATH_PART.fullmatch(part) for part in parts):
        raise field_error("path", f"{str(path)[:200]!r}: give a path relative to your team's import folder, of "
                          "letters, digits, '.', '_', '-' and spaces, with no part starting with '.' (no '..')")
    if not team_root.is_dir():
        raise field_error("path", f"your team has no import folder yet: the operator creates <import root>/{team.slug}/")
    try:
        found = team_root.joinpath(*parts).resolve(strict=True)
    except (OSError, RuntimeError):  # missing, or a symlink loop
        raise field_error("path", f"no folder {text!r} in your team's import folder") from None
    if not found.is_relative_to(team_root.resolve()):
        raise field_error("path", f"{text!r} leads outside your team's import folder (through a symlink): refused")
    if not found.is_dir():
        raise field_error("path", f"{text!r} is a file: name the folder save_to_disk wrote")
    return found


def import_folders(team) -> dict:
    """What the team may import: the save_to_disk folders under its import folder (a few
    levels deep, symlinks not followed), each with its splits."""
    root = settings.FLUXRL_DATASET_IMPORT_ROOT
    found = []
    team_root = Path(root) / team.slug if root else None
    if team_root and team_root.is_dir():
        for folder, subfolders, files in os.walk(team_root):
            depth = len(Path(folder).relative_to(team_root).parts)
            subfolders[:] = sorted(d for d in subfolders if not d.startswith(".")) if depth < 4 else []
            if any(marker in files for marker in FOLDER_MARKERS) and depth > 0:
                subfolders[:] = []  # a dataset's own split folders are not datasets to list
                splits = []
                if "dataset_dict.json" in files:
                    try:
                        splits = columnar.split_names(Path(folder))
                    except InvalidInput:
                        continue
                found.append({"path": Path(folder).relative_to(team_root).as_posix(), "splits": splits})
                if len(found) >= MAX_IMPORT_FOLDERS:
                    break
    return {"enabled": bool(root), "folders": found}


class _ArchiveBudget:
    """What an archive's members declare, checked header by header (fluxrl.archives)."""

    def __init__(self, limit: int):
        self.limit, self.declared, self.entries = limit, 0, 0

    def header(self, name: str, size: int) -> None:
        if self.entries >= MAX_ARCHIVE_FILES:  # folders count too: a bomb of empty members stops here
            raise field_error("file", f"the archive holds more than {MAX_ARCHIVE_FILES} files")
        self.entries += 1
        self.declared += max(0, size)
        if self.declared > self.limit:
            raise TooLarge(f"The archive's files take more than {self.limit} bytes (at {name!r}); the limit is "
                           f"{self.limit} bytes (FLUXRL_MAX_DATASET_MB).", fields={"file": "too large"})


def _skipped_member(name: str) -> bool:
    """Files an archiver adds beside the folder (macOS Finder's resource forks and .DS_Store)."""
    return name.startswith("__MACOSX/") or name.rsplit("/", 1)[-1] == ".DS_Store"


def unpack_dataset_archive(archive: Path, display: str, into: Path) -> Path:
    """Write the archive's .arrow and .json files into ``into`` (never a link, a climbing or
    hidden name, or more than the dataset limit) and return the save_to_disk folder in it:
    ``into`` itself or its one top folder."""
    budget = _ArchiveBudget(max_dataset_bytes())
    for name, size, opener in members(archive, display, budget, "dataset", MAX_ARCHIVE_FILES):
        if _skipped_member(name):
            continue
        stored = "/".join(clean_name(name))
        if not stored.endswith((".arrow", ".json")):
            raise field_error("file", f"{name}: not a file of a save_to_disk folder (.arrow data, .json metadata)")
        if stored.endswith(".json") and size > columnar.MAX_JSON_BYTES:
            raise field_error("file", f"{name} is {size} bytes: not a datasets metadata file")
        target = into / stored
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            out = open(target, "xb")
        except OSError:  # the same name twice, or "a" and "a/b"
            raise field_error("file", f"{name}: clashes with another file of the archive") from None
        written = 0
        with opener() as src, out:
            while chunk := read_chunk(src, name):
                written += len(chunk)
                if written > size:  # a header that lied about the size
                    raise field_error("file", f"{name}: more bytes than its header says")
                out.write(chunk)
    if any((into / marker).is_file() for marker in FOLDER_MARKERS):
        return into
    tops = list(into.iterdir())
    if len(tops) == 1 and tops[0].is_dir() and any((tops[0] / m).is_file() for m in FOLDER_MARKERS):
        return tops[0]
    raise field_error("file", "the archive holds no save_to_disk folder: state.json or dataset_dict.json must be at "
                      "its top or in its one top folder")


def _source_label(name: str, split: str) -> str:
    return (f"{name} [{split}]" if split else name)[:200]


def _decoded_version(team, user, name, kind: str, source: Path, prompt_field: str, answer_field: str,
                     description: str, meta: dict, field: str = "file") -> DatasetVersion:
    """Store a Parquet or Arrow file or a save_to_disk folder (kind "folder") as the next
    version. A memory-capped child process decodes and checks it and writes the version's
    JSONL into a hidden file beside the versions; this process never parses a row of it
    (one row can be as large as the dataset limit): it counts and hashes the file a chunk
    at a time and renames it into place. On any refusal the file is removed."""
    fd, name_out = tempfile.mkstemp(dir=datasets_dir(), prefix=".decoded-")
    os.close(fd)
    out = Path(name_out)
    try:
        result = convert.run(kind, source, prompt_field=prompt_field, answer_field=answer_field, field=field,
                             max_bytes=max_dataset_bytes(), max_row_bytes=max_row_bytes(),
                             memory_mb=settings.FLUXRL_DATASET_CONVERT_MEMORY_MB,
                             timeout_s=settings.FLUXRL_DATASET_CONVERT_TIMEOUT_S, out=out)
        sha256, size, count = _count_jsonl(out)
        if (count, size) != (result["rows"], result["bytes"]):  # a bug, not the user's file
            raise RuntimeError(f"the dataset conversion wrote {count} rows, {size} bytes but reported "
                               f"{result['rows']} rows, {result['bytes']} bytes")
        _check_total(size, count)
        os.chmod(out, 0o444)
        return _commit(team, user, name, out, sha256, size, count, result["columns"], description, meta)
    finally:
        out.unlink(missing_ok=True)  # moved into place, or refused


def _count_jsonl(path: Path) -> tuple[str, int, int]:
    """(sha256, bytes, rows) of a JSONL file, read in fixed-size chunks: a row is never held."""
    digest, size, count, last = hashlib.sha256(), 0, 0, b"\n"
    with open(path, "rb") as fh:
        while chunk := fh.read(READ_CHUNK):
            digest.update(chunk)
            size += len(chunk)
            count += chunk.count(b"\n")
            last = chunk[-1:]
    if last != b"\n":  # the writer ends every row with one
        raise RuntimeError(f"{path.name}: the dataset conversion's output does not end a row")
    return digest.hexdigest(), size, count


def _check_total(size: int, count: int, empty: str = "there are no rows") -> None:
    limit = max_dataset_bytes()
    if size > limit:
        raise TooLarge(f"The rows take {size} bytes as JSONL; the limit is {limit} bytes (FLUXRL_MAX_DATASET_MB).",
                       fields={"file": "too large"})
    if not count:
        raise field_error("file", empty)


@contextmanager
def _on_disk(upload):
    """The path of an uploaded file: Django's temporary file, or a hidden copy of a small
    upload held in memory."""
    if hasattr(upload, "temporary_file_path"):
        yield Path(upload.temporary_file_path())
        return
    fd, path = tempfile.mkstemp(dir=datasets_dir(), prefix=".upload-")
    try:
        with os.fdopen(fd, "wb") as fh:
            for chunk in upload.chunks():
                fh.write(chunk)
        yield Path(path)
    finally:
        os.unlink(path)


def _check_room(team, user) -> None:
    """A team (or uploader, or organisation) already at its storage quota is refused before
    anything is staged or decoded."""
    with transaction.atomic():
        check_storage(team, 0, 1, user)


def _add_folder_version(team, user, name, folder: Path, split: str, prompt_field: str, answer_field: str,
                        field: str, description: str, meta: dict, shown: str) -> DatasetVersion:
    """Store a save_to_disk folder's rows (its split chosen if it holds a DatasetDict)."""
    chosen, split = columnar.split_folder(folder, split, field)
    return _decoded_version(team, user, name, "folder", chosen, prompt_field, answer_field, description,
                            {**meta, "source_name": _source_label(shown, split)}, field)


def import_folder(team, user, name: str, path: str, *, split: str = "", prompt_field="prompt",
                  answer_field="answer", description: str = "") -> DatasetVersion:
    """Import a save_to_disk folder from the team's import folder as a new version."""
    check_name(name)
    folder = resolve_import_path(team, path)
    shown = folder.relative_to(team_import_folder(team).resolve()).as_posix()
    _check_room(team, user)
    meta = {"source": DatasetVersion.Source.HF_DATASET, "source_fields": {"prompt": prompt_field, "answer": answer_field}}
    with _reported_on("path"):
        return _add_folder_version(team, user, name, folder, split, prompt_field, answer_field, "path", description,
                                   meta, shown)


# --- storing versions ------------------------------------------------------------------


def datasets_dir() -> Path:
    folder = Path(settings.FLUXRL_DATA_DIR) / "datasets"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _stage(rows) -> tuple[Path, str, int, int, list]:
    """Write (label, normalized row) pairs as JSONL to a hidden file beside the versions, one
    at a time (the rows never all sit in memory): (path, sha256, bytes, rows, columns). A
    row over FLUXRL_DATASET_MAX_ROW_BYTES or rows over the dataset limit, or any error,
    leave nothing."""
    limit, row_limit = max_dataset_bytes(), max_row_bytes()
    fd, tmp = tempfile.mkstemp(dir=datasets_dir(), prefix=".staging-")
    digest, size, count, columns = hashlib.sha256(), 0, 0, {}
    try:
        with os.fdopen(fd, "wb") as fh:
            for label, row in rows:
                line = encode_row(row, label, row_limit)
                size += len(line)
                if size > limit:
                    raise TooLarge(f"The rows take more than {limit} bytes as JSONL (at {label}); the limit "
                                   f"is {limit} bytes (FLUXRL_MAX_DATASET_MB).", fields={"file": "too large"})
                digest.update(line)
                fh.write(line)
                count += 1
                columns.update(dict.fromkeys(row))
        os.chmod(tmp, 0o444)
    except BaseException:
        os.unlink(tmp)
        raise
    return Path(tmp), digest.hexdigest(), size, count, list(columns)


def add_version(team, user, name: str, rows, description: str = "", **meta) -> DatasetVersion:
    """Store rows (any iterable of normalized dicts) as the next version of the team's
    dataset `name` (created if new)."""
    labelled = ((f"row {number}", row) for number, row in enumerate(rows, 1))
    return _add_labelled(team, user, name, labelled, description, meta)


def _add_labelled(team, user, name: str, rows, description: str, meta: dict,
                  empty: str = "there are no rows") -> DatasetVersion:
    check_name(name)
    _check_room(team, user)  # an over-quota team makes the server write nothing
    staged, sha256, size, count, columns = _stage(rows)
    try:
        _check_total(size, count, empty)
        return _commit(team, user, name, staged, sha256, size, count, columns, description, meta)
    finally:
        staged.unlink(missing_ok=True)  # moved into place, or refused


@transaction.atomic
def _commit(team, user, name, staged: Path, sha256, size, count, columns, description, meta) -> DatasetVersion:
    check_storage(team, size, 1, user)  # team's, uploader's, org's quotas; locked until the version is stored
    dataset, _ = Dataset.objects.get_or_create(team=team, name=name, defaults={"created_by": user, "description": description})
    dataset = Dataset.objects.select_for_update().get(pk=dataset.pk)  # serializes version numbers
    number = next_version_number(dataset)
    relative = Path("datasets") / str(team.id) / str(dataset.id) / f"v{number}-{sha256[:12]}.jsonl"
    final = Path(settings.FLUXRL_DATA_DIR) / relative
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staged, final)  # readers never see a half-written file
    return DatasetVersion.objects.create(
        dataset=dataset, version=number, file=str(relative), sha256=sha256, size_bytes=size,
        row_count=count, columns=columns, created_by=user, **meta,
    )


def upload_version(team, user, name: str, upload, *, prompt_field="prompt", answer_field="answer",
                   fmt: str | None = None, split: str = "", description: str = "") -> DatasetVersion:
    """Validate an uploaded file (a Django UploadedFile: JSONL, CSV, Parquet, Arrow, or a
    save_to_disk folder as an archive) and store it as a new version."""
    check_name(name)
    limit = settings.FLUXRL_MAX_UPLOAD_BYTES
    if upload.size > limit:
        raise TooLarge(f"The file is {upload.size} bytes; the limit is {limit} bytes.", fields={"file": "too large"})
    fmt = detect_format(upload.name, fmt)
    check_content_type(getattr(upload, "content_type", ""), fmt)
    if split and fmt != "hf_dataset":
        raise field_error("split", "only a save_to_disk folder (a .zip or .tar archive) has splits")
    display = safe_upload_name(upload.name)
    _check_room(team, user)
    meta = {"source": fmt, "source_name": display, "source_fields": {"prompt": prompt_field, "answer": answer_field}}
    if fmt in TEXT_FORMATS:
        return _add_labelled(team, user, name, upload_rows(upload, fmt, prompt_field, answer_field), description,
                             meta, empty="the file has no rows")
    if fmt in ("parquet", "arrow"):
        with _on_disk(upload) as path:
            return _decoded_version(team, user, name, fmt, path, prompt_field, answer_field, description, meta)
    return _upload_folder_archive(team, user, name, upload, display, split, description, meta)


def _upload_folder_archive(team, user, name, upload, display, split, description, meta) -> DatasetVersion:
    if not display.lower().endswith(ARCHIVE_SUFFIXES):
        raise field_error("file", f"{display}: upload a save_to_disk folder as a .zip, .tar or .tar.gz archive")
    staging = Path(tempfile.mkdtemp(dir=datasets_dir(), prefix=".import-"))
    try:
        archive = staging / "archive"
        with open(archive, "wb") as fh:
            for chunk in upload.chunks():
                fh.write(chunk)
        (staging / "folder").mkdir()
        folder = unpack_dataset_archive(archive, display, staging / "folder")
        archive.unlink()
        fields = meta["source_fields"]
        return _add_folder_version(team, user, name, folder, split, fields["prompt"], fields["answer"], "file",
                                   description, meta, display)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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

