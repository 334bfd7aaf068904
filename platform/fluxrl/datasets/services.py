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
in memory whole. The team's storage quota is checked before anything is staged.

Reading an upload is parsing.py's, the import root and archives are imports.py's: this
module stages, checks quotas and writes versions."""
from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from django.conf import settings
from django.db import transaction

from fluxrl.archives import ARCHIVE_SUFFIXES
from fluxrl.errors import InvalidInput, NotFound, TooLarge, field_error
from fluxrl.quotas.services import check_storage
from fluxrl.validation import safe_upload_name
from fluxrl.versioned import check_name, find_version, next_version_number
from workers.tasks.datasets import GENERATORS, generate

from . import columnar, convert
from .models import Dataset, DatasetVersion
from .imports import resolve_import_path, team_import_folder, unpack_dataset_archive
from .parsing import READ_CHUNK, TEXT_FORMATS, check_content_type, detect_format, max_dataset_bytes, max_row_bytes, upload_rows
from .rows import encode_row, normalize_row

MAX_GENERATED_ROWS = 200_000


@contextmanager
def _reported_on(field: str):
    """Problems with the rows reported on ``field`` (an import request has no file)."""
    try:
        yield
    except InvalidInput as exc:
        if set(exc.fields) != {"file"}:
            raise
        raise field_error(field, exc.fields["file"]) from None


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

