"""Decoding a columnar upload (Parquet, Arrow IPC, a save_to_disk folder's .arrow files) in
a child process under a memory cap, never in the web process: a file of a few KB can
expand to gigabytes when decoded (compressed IPC buffers, Parquet dictionary pages), and
a batch's size is only known once it is decoded.

The web process runs ``python -m fluxrl.datasets.convert`` with the job as JSON on stdin
(``run()`` below); the child caps its address space (RLIMIT_AS) before pyarrow is loaded,
writes the raw rows as JSON lines to the job's output file, and prints one JSON result:
{"rows": n}, or {"error": {...}} with the same refusal columnar.py raises (the row or
column named), or {"memory": true} when the cap was hit. A child killed or past its wall
clock is reported by the parent. Nothing here touches the database."""
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
OUTPUT_SLACK = 2  # renamed columns and numbers made text: the parent's staging enforces the exact limit


def _memory_error(memory_mb: int) -> TooLarge:
    return TooLarge(f"The file expands past the {memory_mb} MB memory limit for reading it when decoded "
                    "(FLUXRL_DATASET_CONVERT_MEMORY_MB); nothing was stored. Write it uncompressed or with "
                    "smaller batches or row groups.",
                    fields={"file": f"expands past the {memory_mb} MB memory limit when decoded"})


def run(kind: str, source: Path, *, prompt_field: str, answer_field: str, field: str, max_bytes: int,
        memory_mb: int, timeout_s: float, out: Path) -> int:
    """Decode ``source`` in a capped child process into ``out`` (raw rows, one JSON object a
    line); the number of rows, or the child's refusal raised here."""
    job = {"kind": kind, "source": str(source), "prompt_field": prompt_field, "answer_field": answer_field,
           "field": field, "max_bytes": max_bytes, "memory_mb": memory_mb, "out": str(out)}
    package_root = str(Path(__file__).resolve().parents[2])  # the folder holding fluxrl/
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p),
           # one arena and one thread: glibc reserves 64 MB of address space per thread arena
           "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1", "ARROW_DEFAULT_MEMORY_POOL": "system"}
    with tempfile.TemporaryFile() as stderr:
        try:
            done = subprocess.run([sys.executable, "-m", "fluxrl.datasets.convert"], input=json.dumps(job).encode(),
                                  stdout=subprocess.PIPE, stderr=stderr, env=env, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:  # run() has killed the child
            raise InvalidInput(f"file: reading the file took longer than {timeout_s:g} s "
                               "(FLUXRL_DATASET_CONVERT_TIMEOUT_S)",
                               fields={"file": f"reading it took longer than {timeout_s:g} s"}) from None
        stderr.seek(max(0, stderr.seek(0, 2) - 2000))
        tail = stderr.read().decode(errors="replace")
    try:
        result = json.loads(done.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        result = None
    if isinstance(result, dict) and isinstance(result.get("rows"), int) and done.returncode == 0:
        return result["rows"]
    if isinstance(result, dict) and isinstance(result.get("error"), dict):
        error = result["error"]
        cls = TooLarge if error.get("class") == "TooLarge" else InvalidInput
        raise cls(str(error.get("message")), fields={str(k): str(v) for k, v in (error.get("fields") or {}).items()})
    # the cap hit where Python cannot catch it (an allocation inside pyarrow aborts), or a kill
    log.warning("dataset conversion child exited %s without a result: %s", done.returncode, tail[-500:])
    raise _memory_error(memory_mb)


# --- the child ---------------------------------------------------------------------------


def _cap_memory(memory_mb: int) -> None:
    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _convert(job: dict) -> int:
    from . import columnar  # pyarrow is loaded after the cap is set

    columnar.single_threaded()
    kind, source, field = job["kind"], Path(job["source"]), job["field"]
    prompt_field, answer_field, max_bytes = job["prompt_field"], job["answer_field"], int(job["max_bytes"])
    if kind == "folder":
        rows = columnar.saved_dataset_rows(source, prompt_field, answer_field, field, max_bytes=max_bytes)
        return _write(rows, Path(job["out"]), max_bytes)
    with open(source, "rb") as fh:
        if kind == "parquet":
            rows = columnar.parquet_rows(fh, prompt_field, answer_field, max_bytes)
        else:
            rows = columnar.arrow_rows(fh, prompt_field, answer_field, max_bytes=max_bytes)
        return _write(rows, Path(job["out"]), max_bytes)


def _write(rows, out: Path, max_bytes: int) -> int:
    count, size = 0, 0
    with open(out, "wb") as fh:
        for label, row in rows:
            line = (json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n").encode()
            size += len(line)
            if size > OUTPUT_SLACK * max_bytes:
                raise TooLarge(f"The rows take more than {max_bytes} bytes as JSONL (at {label}); the limit is "
                               f"{max_bytes} bytes (FLUXRL_MAX_DATASET_MB).", fields={"file": "too large"})
            fh.write(line)
            count += 1
    return count


def main() -> int:
    job = json.loads(sys.stdin.read())
    if job.get("kind") not in KINDS:
        raise SystemExit(f"unknown kind {job.get('kind')!r}")
    _cap_memory(int(job["memory_mb"]))
    try:
        result = {"rows": _convert(job)}
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
