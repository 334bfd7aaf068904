"""Reading columnar data (Parquet, Arrow IPC, Hugging Face ``save_to_disk`` folders) as raw
rows, which the conversion child (convert.py) normalizes like JSONL rows (rows.py). A file
is read a batch at a time, never whole: a Parquet row group whose uncompressed size is over
the dataset limit is refused from its metadata before it is read, and a batch whose text is
over the limit, or a row whose text is over the per-row limit, is refused before it becomes
Python rows. These readers decode untrusted files: the web process runs them only in a
memory-capped child process (convert.py). Before any row, the schema is checked: the prompt
and answer columns exist and have a usable type, and every column holds only what a JSON
row can (text, numbers, booleans, and lists or structs of them): binary, dates, decimals,
maps and the like are refused by column, since a run's rows are JSON."""
from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from fluxrl.errors import TooLarge, field_error

from .rows import row_too_large

BATCH_ROWS = 1024
PARQUET_BATCH_BYTES = 64 * 1024 * 1024  # wide rows: fewer of them per decoded batch
MAX_JSON_BYTES = 1024 * 1024  # state.json, dataset_dict.json: a few hundred bytes in practice
PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")  # one path part; no leading dot, no '..'
READ_ERRORS = (pa.ArrowException, OSError, ValueError)  # ArrowInvalid and IOError are among these


def single_threaded() -> None:
    """One decoding thread: a capped child's address space is not spent on thread stacks."""
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)


def _refuse(message: str, field: str = "file"):
    return field_error(field, message)


# --- the schema -------------------------------------------------------------------------


def _json_type_problem(t: pa.DataType) -> str | None:
    """Why values of type t cannot be JSON row values, or None if they can."""
    if isinstance(t, pa.ExtensionType):
        return f"an extension type ({t.extension_name})"
    if pa.types.is_dictionary(t):
        return _json_type_problem(t.value_type)
    if pa.types.is_float16(t):
        return "half-precision floats"
    if (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t) or pa.types.is_floating(t)
            or pa.types.is_boolean(t) or pa.types.is_null(t) or getattr(pa.types, "is_string_view", bool)(t)):
        return None
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t) \
            or getattr(pa.types, "is_list_view", bool)(t) or getattr(pa.types, "is_large_list_view", bool)(t):
        return _json_type_problem(t.value_type)
    if pa.types.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        if len(set(names)) != len(names):
            return "a struct that names a field twice"
        return next((p for i in range(t.num_fields) if (p := _json_type_problem(t.field(i).type))), None)
    return str(t)


def _is_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        return _is_text(t.value_type)
    return pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", bool)(t)


def check_schema(schema: pa.Schema, prompt_field: str, answer_field: str, field: str = "file") -> None:
    """Refuse, by column, a schema whose rows could not become {"prompt", "answer", ...}."""
    names = schema.names
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise _refuse(f"the column {twice[0]!r} appears twice: each column needs its own name", field)
    shown = ", ".join(repr(n) for n in names[:20]) + (", ..." if len(names) > 20 else "")
    if prompt_field not in names and "messages" not in names:
        raise _refuse(f"no column {prompt_field!r} (or a chat 'messages' column); the columns are: {shown}",
                      "prompt_field")
    if answer_field not in names:
        raise _refuse(f"no column {answer_field!r}; the columns are: {shown}", "answer_field")
    for column in schema:
        problem = _json_type_problem(column.type)
        if problem:
            inner = "" if problem == str(column.type) else f" ({problem} cannot be a JSON row value)"
            raise _refuse(f"column {column.name!r} has type {column.type}{inner}: a JSON row holds only text, "
                          "numbers, booleans and lists or structs of them", field)
    if prompt_field in names and not _is_text(schema.field(prompt_field).type):
        raise _refuse(f"column {prompt_field!r} has type {schema.field(prompt_field).type}: the prompt must be text",
                      "prompt_field")
    answer_type = schema.field(answer_field).type
    if not (_is_text(answer_type) or pa.types.is_integer(answer_type) or pa.types.is_floating(answer_type)):
        raise _refuse(f"column {answer_field!r} has type {answer_type}: the answer must be text or a number",
                      "answer_field")


def _text_bytes(batch) -> pa.Array | None:
    """Per row, the bytes of its top-level text columns (a dictionary column by its indices,
    never decoded), or None if it has none."""
    total = None
    for column in batch.columns:
        if not _is_text(column.type):
            continue
        if pa.types.is_dictionary(column.type):
            lengths = pc.take(pc.binary_length(column.dictionary), column.indices)
        else:
            lengths = pc.binary_length(column)
        lengths = pc.fill_null(lengths.cast(pa.int64()), 0)
        total = lengths if total is None else pc.add(total, lengths)
    return total


def _check_text_size(batch, first: int, max_bytes: int | None, max_row_bytes: int | None = None) -> None:
    """Refuse a batch whose text alone is over the dataset limit, or a row of it whose text
    is over the per-row limit, before it becomes Python objects (its JSON rows could only be
    larger)."""
    if max_bytes is None or not batch.num_rows:
        return
    lengths = _text_bytes(batch)
    if lengths is None:
        return
    largest = pc.max(lengths).as_py() or 0
    if largest > max_bytes:
        row = first + pc.index(lengths, largest).as_py() + 1
        raise TooLarge(f"row {row} holds {largest} bytes of text; the limit is {max_bytes} bytes "
                       "(FLUXRL_MAX_DATASET_MB)", fields={"file": f"row {row} is too large"})
    total = pc.sum(lengths).as_py() or 0
    if total > max_bytes:
        raise TooLarge(f"rows {first + 1} to {first + batch.num_rows} hold {total} bytes of text; the limit is "
                       f"{max_bytes} bytes (FLUXRL_MAX_DATASET_MB)", fields={"file": "too large"})
    if max_row_bytes is not None and largest > max_row_bytes:
        index = pc.index(pc.greater(lengths, max_row_bytes), True).as_py()  # the first row over the cap
        raise row_too_large(f"row {first + index + 1}", lengths[index].as_py(), max_row_bytes, "of text")


def _rows(batches, start: int = 0, max_bytes: int | None = None, batch_rows: int = BATCH_ROWS,
          max_row_bytes: int | None = None):
    """(label, row dict) for each row of the batches, numbered from 1 across the file."""
    number = start
    for batch in batches:
        for offset in range(0, batch.num_rows, batch_rows):  # a writer's batch may hold 64K rows
            part = batch.slice(offset, batch_rows)
            _check_text_size(part, number, max_bytes, max_row_bytes)
            for row in part.to_pylist():
                number += 1
                yield f"row {number}", row


# --- Parquet and Arrow IPC files -------------------------------------------------------------


def parquet_rows(source, prompt_field: str, answer_field: str, max_bytes: int, max_row_bytes: int | None = None):
    """(label, row) for each row of a Parquet file (a seekable binary file)."""
    try:
        parquet = pq.ParquetFile(source)
    except READ_ERRORS as exc:
        _reraise_memory(exc)
        raise _refuse(f"not a Parquet file ({_short(exc)})") from None
    schema = parquet.schema_arrow
    check_schema(schema, prompt_field, answer_field)
    meta = parquet.metadata
    batch_rows = BATCH_ROWS
    for index in range(meta.num_row_groups):
        group = meta.row_group(index)
        size = group.total_byte_size
        if size > max_bytes:
            raise TooLarge(f"row group {index} of the Parquet file holds {size} bytes uncompressed; the limit is "
                           f"{max_bytes} bytes (FLUXRL_MAX_DATASET_MB): write it with smaller row groups",
                           fields={"file": "too large"})
        if group.num_rows and size:  # the writer's word only: the text check and the memory cap stand behind it
            batch_rows = max(1, min(batch_rows, PARQUET_BATCH_BYTES * group.num_rows // size))
    # text columns read as dictionaries: a page of one repeated value is sized before it is decoded
    text = [name for name in schema.names if _is_text(schema.field(name).type)]
    try:
        if text:
            parquet = pq.ParquetFile(source, read_dictionary=text)
        batches = parquet.iter_batches(batch_size=batch_rows, use_threads=False)
    except READ_ERRORS as exc:
        _reraise_memory(exc)
        raise _refuse(f"not a Parquet file ({_short(exc)})") from None
    yield from _guarded(_rows(batches, max_bytes=max_bytes, batch_rows=batch_rows, max_row_bytes=max_row_bytes),
                        "Parquet")


def arrow_rows(source, prompt_field: str, answer_field: str, max_bytes: int | None = None,
               max_row_bytes: int | None = None):
    """(label, row) for each row of an Arrow IPC file or stream (a seekable binary file)."""
    yield from _reader_rows(open_arrow(source), prompt_field, answer_field, max_bytes=max_bytes,
                            max_row_bytes=max_row_bytes)


def _reader_rows(reader, prompt_field: str, answer_field: str, first_row: int = 0, field: str = "file",
                 max_bytes: int | None = None, max_row_bytes: int | None = None):
    check_schema(reader.schema, prompt_field, answer_field, field)
    if isinstance(reader, ipc.RecordBatchFileReader):
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
        batches = iter(reader)
    yield from _guarded(_rows(batches, first_row, max_bytes, max_row_bytes=max_row_bytes), "Arrow", field)


def open_arrow(source, field: str = "file"):
    """A reader of an Arrow IPC file (magic 'ARROW1', as written by pyarrow.feather or
    ipc.new_file) or stream (ipc.new_stream, as in a save_to_disk folder) in a seekable
    binary file."""
    head = source.read(6)
    source.seek(0)
    if head.startswith(b"FEA1"):
        raise _refuse("a Feather version 1 file: rewrite it as Feather 2 / Arrow IPC "
                      "(pyarrow.feather.write_feather(table, path))", field)
    try:
        return ipc.open_file(source) if head == b"ARROW1" else ipc.open_stream(source)
    except (*READ_ERRORS, MemoryError) as exc:  # a header declaring gigabytes fails to allocate under the cap
        reason = "its header declares more bytes than can be read" if isinstance(exc, MemoryError) else _short(exc)
        raise _refuse(f"not an Arrow IPC file or stream ({reason})", field) from None


def _guarded(rows, what: str, field: str = "file"):
    """Rows, a damaged page or batch found while reading refused by where it was met."""
    label = None
    try:
        for label, row in rows:
            if _non_finite(row):
                raise _refuse(f"{label}: a number is NaN or infinite, which a JSON row cannot hold", field)
            yield label, row
    except READ_ERRORS as exc:
        _reraise_memory(exc)
        where = f"after {label}" if label else "before the first row"
        raise _refuse(f"{where}: the {what} data is damaged ({_short(exc)})", field) from None


def _reraise_memory(exc: Exception) -> None:
    """pyarrow's ArrowMemoryError is an ArrowException too: a file that expands past the
    memory cap is too large, not damaged."""
    if isinstance(exc, MemoryError):
        raise exc


def _non_finite(value) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_non_finite(v) for v in value)
    return False


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:300]


# --- Hugging Face datasets folders (save_to_disk) -------------------------------------------


def _read_small_json(path: Path, shown: str, field: str):
    """A folder's JSON metadata file, never through a symlink, capped before it is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError:
        raise _refuse(f"{shown}: not a regular file (symlinks are not followed)", field) from None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise _refuse(f"{shown}: not a regular file", field)
        data = fh.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise _refuse(f"{shown} is over {MAX_JSON_BYTES} bytes: not a datasets metadata file", field)
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise _refuse(f"{shown} is not valid JSON", field) from None


def _plain_entry(folder: Path, name: str, field: str) -> Path:
    """folder/name, where name is one plain path part and a regular file or a folder, not a
    symlink (never followed, so it cannot lead out of the folder)."""
    if not isinstance(name, str) or not PLAIN_NAME.fullmatch(name):
        raise _refuse(f"{name!r} is not a plain file or folder name", field)
    path = folder / name
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise _refuse(f"{name}: missing from the folder", field) from None
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise _refuse(f"{name}: a symlink or special file (only plain files and folders are read)", field)
    return path


def split_names(folder: Path, field: str = "path") -> list[str] | None:
    """The splits dataset_dict.json lists, or None if the folder holds no DatasetDict."""
    splits_file = _read_small_json(folder / "dataset_dict.json", "dataset_dict.json", field)
    if splits_file is None:
        return None
    splits = splits_file.get("splits") if isinstance(splits_file, dict) else None
    if not isinstance(splits, list) or not splits or not all(isinstance(s, str) for s in splits):
        raise _refuse("dataset_dict.json does not list the splits", field)
    return splits


def split_folder(folder: Path, split: str, field: str) -> tuple[Path, str]:
    """The folder of one Dataset: ``folder`` itself, or its split ``split`` if it holds a
    DatasetDict (dataset_dict.json). Returns (folder, split used)."""
    splits = split_names(folder, field)
    if splits is not None:
        if not split and len(splits) == 1:
            split = splits[0]
        if not split:
            raise _refuse(f"the folder holds a DatasetDict: choose a split ({', '.join(splits)})", "split")
        if split not in splits:
            raise _refuse(f"no split {split!r}; the splits are: {', '.join(splits)}", "split")
        chosen = _plain_entry(folder, split, "split")
        if not chosen.is_dir():
            raise _refuse(f"the split {split!r} is not a folder", "split")
        return chosen, split
    if split:
        raise _refuse("the folder holds one Dataset, not a DatasetDict: leave the split empty", "split")
    return folder, ""


def saved_dataset_rows(folder: Path, prompt_field: str, answer_field: str, field: str = "path",
                       max_bytes: int | None = None, max_row_bytes: int | None = None):
    """(label, row) for each row of a folder written by ``Dataset.save_to_disk``: its
    state.json names the Arrow data files (plain names in the folder, read in order, no
    symlink followed)."""
    state = _read_small_json(folder / "state.json", "state.json", field)
    if state is None:
        raise _refuse("not a folder written by save_to_disk: it has neither state.json nor dataset_dict.json", field)
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not files or not all(isinstance(f, dict) for f in files):
        raise _refuse("state.json lists no data files", field)
    if state.get("_indices_data_files"):
        raise _refuse("the dataset has an indices mapping: save it again after flatten_indices()", field)
    paths = []
    for entry in files:
        name = entry.get("filename")
        path = _plain_entry(folder, name, field)
        if not name.endswith(".arrow") or not path.is_file():
            raise _refuse(f"{name}: a data file must be a .arrow file in the folder", field)
        paths.append(path)
    count, schema = 0, None
    for path in paths:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as fh:
            reader = open_arrow(fh, field)
            if schema is not None and not reader.schema.equals(schema, check_metadata=False):
                raise _refuse(f"{path.name}: its columns differ from the first data file's", field)
            schema = reader.schema
            for label, row in _reader_rows(reader, prompt_field, answer_field, count, field, max_bytes,
                                           max_row_bytes):
                count += 1
                yield label, row
