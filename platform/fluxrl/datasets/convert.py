"""Decoding a columnar upload (Parquet, Arrow IPC, a save_to_disk folder's .arrow files) in
a child process under a memory cap, never in the web process: a file of a few KB can
expand to gigabytes when decoded (compressed IPC buffers, Parquet dictionary pages), and
a batch's size is only known once it is decoded.

The web process runs ``python -m fluxrl.datasets.convert`` with the job as JSON on stdin
(``run()`` below); the child caps its address space (RLIMIT_AS) before pyarrow is loaded,
normalizes each row (rows.py), refuses a row over FLUXRL_DATASET_MAX_ROW_BYTES and rows
over FLUXRL_MAX_DATASET_MB, and writes the rows as the version's final JSONL to the job's
output file. It prints one JSON result: {"rows": n, "bytes": size, "columns": [...]}, or
{"error": {...}} with the same refusal columnar.py or rows.py raises (the row or column
named; a MemoryError under the cap becomes the memory refusal). A child killed or past
its wall clock is reported by the parent. The web process never parses a row of the
output: it only counts and hashes the file in fixed-size chunks and renames it into place
(services.py), as a row can be as large as the decoded file. Nothing here touches the
database."""
from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from fluxrl.errors import InvalidInput, TooLarge

log = logging.getLogger(__name__)

KINDS = ("parquet", "arrow", "folder")
# The result line names the columns; every row holds every column, so a result larger than
# this is no result of ours.
RESULT_SLACK = 64 * 1024


def _memory_error(memory_mb: int) -> TooLarge:
    return TooLarge(f"The file expands past the {memory_mb} MB memory limit for reading it when decoded "
                    "(FLUXRL_DATASET_CONVERT_MEMORY_MB); nothing was stored. Write it uncompressed or with "
                    "smaller batches or row groups.",
                    fields={"file": f"expands past the {memory_mb} MB memory limit when decoded"})


def run(kind: str, source: Path, *, prompt_field: str, answer_field: str, field: str, max_bytes: int,
        max_row_bytes: int, memory_mb: int, timeout_s: float, out: Path) -> dict:
    """Decode ``source`` in a capped child process into ``out`` (the normalized rows as the
    version's JSONL); the child's result {"rows", "bytes", "columns"}, or its refusal
    raised here."""
    job = {"kind": kind, "source": str(source), "prompt_field": prompt_field, "answer_field": answer_field,
           "field": field, "max_bytes": max_bytes, "max_row_bytes": max_row_bytes, "memory_mb": memory_mb,
           "out": str(out)}
    package_root = Path(__file__).resolve().parents[2]  # the folder holding fluxrl/
    # rows.py checks chat rows with workers.tasks.datasets: the repository root holds workers/
    roots = (str(package_root), str(package_root.parent), os.environ.get("PYTHONPATH"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in roots if p),
           # one arena and one thread: glibc reserves 64 MB of address space per thread arena
           "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1", "ARROW_DEFAULT_MEMORY_POOL": "system"}
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        try:
            done = subprocess.run([sys.executable, "-m", "fluxrl.datasets.convert"], input=json.dumps(job).encode(),
                                  stdout=stdout, stderr=stderr, env=env, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:  # run() has killed the child
            raise InvalidInput(f"file: reading the file took longer than {timeout_s:g} s "
                               "(FLUXRL_DATASET_CONVERT_TIMEOUT_S)",
                               fields={"file": f"reading it took longer than {timeout_s:g} s"}) from None
        stderr.seek(max(0, stderr.seek(0, 2) - 2000))
        tail = stderr.read().decode(errors="replace")
        stdout.seek(max(0, stdout.seek(0, 2) - (max_row_bytes + RESULT_SLACK)))  # the result line, read bounded
        printed = stdout.read().decode(errors="replace")
    try:
        result = json.loads(printed.strip().splitlines()[-1])
    except (ValueError, IndexError, RecursionError):
        result = None
    if _is_result(result) and done.returncode == 0:
        return result
    if isinstance(result, dict) and isinstance(result.get("error"), dict):
        error = result["error"]
        cls = TooLarge if error.get("class") == "TooLarge" else InvalidInput
        raise cls(str(error.get("message")), fields={str(k): str(v) for k, v in (error.get("fields") or {}).items()})
    # the cap hit where Python cannot catch it (an allocation inside pyarrow aborts), or a kill
    log.warning("dataset conversion child exited %s without a result: %s", done.returncode, tail[-500:])
    raise _memory_error(memory_mb)


def _is_result(result) -> bool:
    return (isinstance(result, dict) and isinstance(result.get("rows"), int) and isinstance(result.get("bytes"), int)
            and isinstance(result.get("columns"), list) and all(isinstance(c, str) for c in result["columns"]))


# --- the child ---------------------------------------------------------------------------


def _cap_memory(memory_mb: int) -> None:
    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _convert(job: dict) -> dict:
    from . import columnar  # pyarrow is loaded after the cap is set
    from .rows import checked_rows

    columnar.single_threaded()
    kind, source, field = job["kind"], Path(job["source"]), job["field"]
    prompt_field, answer_field = job["prompt_field"], job["answer_field"]
    max_bytes, max_row_bytes = int(job["max_bytes"]), int(job["max_row_bytes"])
    caps = {"max_bytes": max_bytes, "max_row_bytes": max_row_bytes}
    if kind == "folder":
        raw = columnar.saved_dataset_rows(source, prompt_field, answer_field, field, **caps)
        return _write(checked_rows(raw, prompt_field, answer_field), Path(job["out"]), max_bytes, max_row_bytes)
    with open(source, "rb") as fh:
        if kind == "parquet":
            raw = columnar.parquet_rows(fh, prompt_field, answer_field, **caps)
        else:
            raw = columnar.arrow_rows(fh, prompt_field, answer_field, **caps)
        return _write(checked_rows(raw, prompt_field, answer_field), Path(job["out"]), max_bytes, max_row_bytes)


def _write(rows, out: Path, max_bytes: int, max_row_bytes: int) -> dict:
    """Write (label, normalized row) pairs as the version's JSONL, each row and the whole
    within their caps; {"rows", "bytes", "columns"}."""
    from .rows import encode_row

    count, size, columns = 0, 0, {}
    with open(out, "wb") as fh:
        for label, row in rows:
            line = encode_row(row, label, max_row_bytes)
            size += len(line)
            if size > max_bytes:
                raise TooLarge(f"The rows take more than {max_bytes} bytes as JSONL (at {label}); the limit is "
                               f"{max_bytes} bytes (FLUXRL_MAX_DATASET_MB).", fields={"file": "too large"})
            fh.write(line)
            count += 1
            columns.update(dict.fromkeys(row))
    return {"rows": count, "bytes": size, "columns": list(columns)}


def main() -> int:
    job = json.loads(sys.stdin.read())
    if job.get("kind") not in KINDS:
        raise SystemExit(f"unknown kind {job.get('kind')!r}")
    _cap_memory(int(job["memory_mb"]))
    try:
        result = _convert(job)
    except (InvalidInput, TooLarge) as exc:
        result = {"error": {"class": type(exc).__name__, "message": exc.message, "fields": exc.fields}}
    except MemoryError:  # pyarrow's ArrowMemoryError is one
        result = {"error": {"class": "TooLarge", "message": _memory_error(int(job["memory_mb"])).message,
                            "fields": _memory_error(int(job["memory_mb"])).fields}}
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
