"""A run's weights to download as a Hugging Face folder (docs/guides/export-model.md).

What a run's engine leaves in its output folder (engine_inputs.run_output_dir) is already
such a folder, so nothing is converted: ``final_model/`` (the trainer's save_pretrained
when the run ends: safetensors, config.json, the tokenizer files) and, per checkpoint,
``checkpoints/step-<N>/model/`` (the same, beside the DeepSpeed state that --resume
reads; workers/io/checkpoint.py). A LoRA run's folders (model.lora) hold the base model
with the adapter merged in, and the adapter alone as a PEFT folder in ``adapter/``
(adapter_config.json, adapter_model.safetensors): ``part=adapter`` sends that. The platform reads them from FLUXRL_DATA_DIR, which
the web server shares with the workers (one volume in docker-compose.yml); a run whose
outputs stayed on a worker's own disk has nothing to export here.

The archive holds the folder's own files and nothing else: regular files (no links)
directly in the folder, with plain names and of the kinds a model folder needs
(modelstore's rules: no pickles, no code). Every file is opened before the first byte is
sent, so a checkpoint rotated away mid-download (the newest two are kept) still streams
whole, and the archive is written as it is sent, a chunk at a time (bounded memory).
"""
from __future__ import annotations

import io
import json
import os
import re
import stat
import tarfile
import tempfile
import threading
import time
import zipfile
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

from django.core.files import File

from fluxrl.errors import Conflict, NotFound, TooLarge, field_error
from fluxrl.modelstore import services as modelstore
from workers.io.checkpoint import list_checkpoints

from .engine_inputs import run_output_dir
from .models import Run

FINAL = "final"
PARTS = ("model", "adapter")  # the whole (merged) model, or a LoRA run's adapter as a PEFT folder
FORMATS = {"tar.gz": "application/gzip", "zip": "application/zip", "tar": "application/x-tar"}
CHUNK = 1 << 20
RESULT_MAX_BYTES = 1 << 20  # result.json is a few hundred bytes
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")  # no leading dot, no separator
_CHECKPOINT = re.compile(r"final|[0-9]{1,18}")


class NotFinished(Conflict):
    code = "not_finished"


class ChangedWhileReading(RuntimeError):
    """A file got shorter while it was sent (something rewrote the folder)."""


@dataclass(frozen=True)
class ModelExport:
    """One downloadable folder of a run: ``checkpoint`` is "final" or the step as text."""

    run_id: int
    checkpoint: str
    step: int | None
    version: int | None
    folder: Path
    files: tuple[tuple[str, int], ...]  # (name, bytes), by name
    adapter: tuple[tuple[str, int], ...] | None = None  # model.lora: the PEFT folder's files in adapter/
    part: str = "model"

    @property
    def size_bytes(self) -> int:
        return sum(size for _, size in self.files)

    @property
    def adapter_bytes(self) -> int | None:
        return None if self.adapter is None else sum(size for _, size in self.adapter)

    @property
    def archive_stem(self) -> str:
        stem = f"run-{self.run_id}-{FINAL if self.checkpoint == FINAL else f'step-{self.step}'}"
        return stem + "-adapter" if self.part == "adapter" else stem

    def adapter_part(self) -> "ModelExport":
        """The same export's adapter folder alone (``part=adapter``)."""
        return replace(self, folder=self.folder / "adapter", files=self.adapter, adapter=None, part="adapter")


def _exported_name(name: str) -> bool:
    suffix = Path(name).suffix.lower()
    return bool(_NAME.fullmatch(name)) and (suffix in modelstore.ALLOWED_SUFFIXES or name in modelstore.ALLOWED_PLAIN)


def _model_files(out: Path, relative: str, needs: str = "config.json") -> tuple[tuple[str, int], ...] | None:
    """The exported files of out/relative, or None when it is not a model folder (absent,
    reached through a link, or without ``needs`` (config.json; an adapter's
    adapter_config.json) and safetensors weights)."""
    folder = out / relative
    if os.path.realpath(folder) != os.path.join(os.path.realpath(out), relative):
        return None  # a link somewhere below the output folder: not the engine's folder
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return None
    files = []
    for entry in entries:
        if _exported_name(entry.name) and entry.is_file(follow_symlinks=False):
            files.append((entry.name, entry.stat(follow_symlinks=False).st_size))
    names = {name for name, _ in files}
    if needs not in names or not any(n.endswith(".safetensors") for n in names):
        return None
    return tuple(sorted(files))


def _final_steps(out: Path) -> int | None:
    """Steps trained, from result.json: the engine writes it after final_model, so it also
    says that final_model is whole."""
    path = out / "result.json"
    try:
        if path.is_symlink() or path.stat().st_size > RESULT_MAX_BYTES:
            return None
        steps = json.loads(path.read_text(encoding="utf-8")).get("steps")
    except (OSError, ValueError, AttributeError):
        return None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else -1


def exportable(run: Run) -> list[ModelExport]:
    """What ``run`` can export now, final model first, then checkpoints, newest first.
    The final model counts once the run has ended and its engine wrote result.json."""
    out = run_output_dir(run.pk)
    found = []
    steps = _final_steps(out) if run.is_terminal else None
    if steps is not None and (files := _model_files(out, "final_model")):
        found.append(ModelExport(run.pk, FINAL, steps if steps >= 0 else None, None, out / "final_model", files,
                                 _model_files(out, "final_model/adapter", "adapter_config.json")))
    for info in reversed(list_checkpoints(out)):
        relative = f"checkpoints/{info.path.name}/model"
        if files := _model_files(out, relative):
            found.append(ModelExport(run.pk, str(info.step), info.step, info.version, out / relative, files,
                                     _model_files(out, f"{relative}/adapter", "adapter_config.json")))
    return found


def _available(found: list[ModelExport]) -> str:
    return ", ".join(e.checkpoint for e in found) or "none"


def find_export(run: Run, checkpoint: str = FINAL, part: str = "model") -> ModelExport:
    """The export ``checkpoint`` names ("final" or a checkpoint's step), or an error that
    says what there is: 400 (bad value), 409 (the run has not ended, for "final"), 404.
    ``part`` "adapter": that export's LoRA adapter alone (404 for a run without model.lora)."""
    if part not in PARTS:
        raise field_error("part", f"{str(part)[:20]!r} is not one of {', '.join(PARTS)}")
    checkpoint = (checkpoint or FINAL).strip().lower()
    if not _CHECKPOINT.fullmatch(checkpoint):
        raise field_error("checkpoint", f"{checkpoint[:40]!r} is neither 'final' nor a checkpoint's step number")
    if checkpoint != FINAL:
        checkpoint = str(int(checkpoint))
    found = exportable(run)
    for export in found:
        if export.checkpoint == checkpoint:
            if part == "model":
                return export
            if export.adapter is None:
                raise NotFound(f"Run {run.pk}'s {export.archive_stem} has no LoRA adapter: only a run with model.lora "
                               "trains one; download the whole model (part=model).",
                               fields={"part": "no adapter in these weights (the run has no model.lora)"})
            return export.adapter_part()
    available = _available(found)
    if checkpoint == FINAL and not run.is_terminal:
        raise NotFinished(f"Run {run.pk} is {run.status}: its final model is saved when it ends. Exportable now: "
                          f"{available} (checkpoints are saved every trainer.checkpoint_every steps).",
                          fields={"checkpoint": f"no final model while the run is {run.status}"})
    if checkpoint == FINAL:
        why = (f"run {run.pk} {run.status} without saving a final model" if run.status != "succeeded" else
               f"run {run.pk}'s final model is not in its output folder on this server")
    else:
        why = (f"run {run.pk} has no checkpoint at step {checkpoint} (a run keeps its newest "
               f"two checkpoints, saved every trainer.checkpoint_every steps)")
    raise NotFound(f"{why[0].upper()}{why[1:]}. Exportable: {available}.",
                   fields={"checkpoint": f"{why}; exportable: {available}"})


# --- the archive ----------------------------------------------------------------------------


@dataclass
class _Opened:
    name: str
    fd: int
    size: int
    mtime: float


def _open_files(export: ModelExport) -> list[_Opened]:
    """Every file of the export, opened (no link followed) and checked to be a regular file."""
    opened: list[_Opened] = []
    try:
        for name, _ in export.files:
            fd = os.open(export.folder / name, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
            info = os.fstat(fd)
            opened.append(_Opened(name, fd, info.st_size, info.st_mtime))
            if not stat.S_ISREG(info.st_mode):
                raise NotFound(f"{export.archive_stem}: {name} is not a regular file.")
    except OSError:
        _close(opened)
        what = "final model" if export.checkpoint == FINAL else f"checkpoint at step {export.checkpoint}"
        raise NotFound(f"Run {export.run_id}'s {what} was removed while it was being read (a run keeps its newest "
                       "two checkpoints): ask again.",
                       fields={"checkpoint": "removed while it was read"}) from None
    except BaseException:
        _close(opened)
        raise
    return opened


def _close(opened: list[_Opened]) -> None:
    for item in opened:
        try:
            os.close(item.fd)
        except OSError:
            pass


def _chunks(item: _Opened) -> Iterator[bytes]:
    """The file's bytes as stat'ed when it was opened, CHUNK at a time."""
    os.lseek(item.fd, 0, os.SEEK_SET)
    left = item.size
    while left:
        chunk = os.read(item.fd, min(CHUNK, left))
        if not chunk:
            raise ChangedWhileReading(f"{item.name} got shorter while it was sent")
        left -= len(chunk)
        yield chunk


def _tar_header(stem: str, item: _Opened) -> bytes:
    info = tarfile.TarInfo(f"{stem}/{item.name}")
    info.size, info.mtime, info.mode, info.type = item.size, int(item.mtime), 0o644, tarfile.REGTYPE
    return info.tobuf(format=tarfile.PAX_FORMAT)  # PAX: sizes past 8 GiB


def _tar(stem: str, opened: list[_Opened]) -> Iterator[bytes]:
    for item in opened:
        yield _tar_header(stem, item)
        yield from _chunks(item)
        if item.size % tarfile.BLOCKSIZE:
            yield tarfile.NUL * (tarfile.BLOCKSIZE - item.size % tarfile.BLOCKSIZE)
    yield tarfile.NUL * (2 * tarfile.BLOCKSIZE)  # the end-of-archive marker


def tar_size(export: ModelExport, opened: list[_Opened]) -> int:
    """The uncompressed tar's exact length (its Content-Length)."""
    total = 2 * tarfile.BLOCKSIZE
    for item in opened:
        total += len(_tar_header(export.archive_stem, item)) + -(-item.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    return total


def _gzip(chunks: Iterator[bytes]) -> Iterator[bytes]:
    # level 1: safetensors weights barely compress, and the CPU time is the download's
    compressor = zlib.compressobj(1, zlib.DEFLATED, 31)  # wbits 31: a gzip stream
    for chunk in chunks:
        if packed := compressor.compress(chunk):
            yield packed
    yield compressor.flush()


class _Sink(io.RawIOBase):
    """Where zipfile writes: collected, handed on by drain(); tell() but no seek(), so
    zipfile streams (data descriptors after each file)."""

    def __init__(self):
        super().__init__()
        self.parts: list[bytes] = []
        self.position = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        self.position += len(data)
        return len(data)

    def tell(self) -> int:
        return self.position

    def drain(self) -> bytes:
        data, self.parts = b"".join(self.parts), []
        return data


def _zip(stem: str, opened: list[_Opened]) -> Iterator[bytes]:
    sink = _Sink()
    with zipfile.ZipFile(sink, "w", compression=zipfile.ZIP_STORED) as archive:
        for item in opened:
            info = zipfile.ZipInfo(f"{stem}/{item.name}", time.localtime(max(item.mtime, 315619200))[:6])
            info.external_attr = 0o644 << 16
            with archive.open(info, "w", force_zip64=item.size >= zipfile.ZIP64_LIMIT) as member:
                for chunk in _chunks(item):
                    member.write(chunk)
                    yield sink.drain()
            yield sink.drain()
    yield sink.drain()


@dataclass
class Archive:
    """An export being sent: its file name, media type, length when known, and chunks
    (a generator; its files are closed when it ends). ``close`` closes them too, whether or
    not the chunks were ever read (a client gone before the first chunk): the response
    calls it when it is closed."""

    filename: str
    content_type: str
    length: int | None
    chunks: Iterator[bytes]
    close: Callable[[], None]


def open_archive(export: ModelExport, fmt: str = "tar.gz") -> Archive:
    """The export as an archive of ``fmt`` (tar.gz, zip or tar), one folder named
    run-<id>-final (or -step-<N>) holding the files. The files are opened here."""
    if fmt not in FORMATS:
        raise field_error("archive", f"{fmt[:20]!r} is not one of {', '.join(FORMATS)}")
    opened = _open_files(export)
    stem = export.archive_stem
    writer = {"tar.gz": lambda: _gzip(_tar(stem, opened)), "tar": lambda: _tar(stem, opened),
              "zip": lambda: _zip(stem, opened)}[fmt]

    lock, still_open = threading.Lock(), [True]

    def release() -> None:  # once: a second close could hit a descriptor number reused since
        with lock:
            if still_open[0]:
                still_open[0] = False
                _close(opened)

    def chunks() -> Iterator[bytes]:
        try:
            for chunk in writer():
                if chunk:
                    yield chunk
        finally:
            release()

    return Archive(f"{stem}.{fmt}", FORMATS[fmt], tar_size(export, opened) if fmt == "tar" else None, chunks(),
                   release)


# --- into the team's models ------------------------------------------------------------------


def save_as_team_model(run: Run, user, checkpoint: str, name: str, description: str = ""):
    """Store the export as the next version of the team's model ``name`` (modelstore),
    checked as an upload is, so a new run can start from ``model:<name>``."""
    export = find_export(run, checkpoint)
    limit = modelstore.max_model_bytes()
    if export.size_bytes > limit:  # before a copy is written (upload_version checks the archive again)
        raise TooLarge(f"{export.archive_stem} is {export.size_bytes} bytes; a team model is at most {limit} bytes "
                       "(FLUXRL_MAX_MODEL_MB).", fields={"checkpoint": "too large for the team's models"})
    archive = open_archive(export, "tar")
    staging = modelstore.store_root()
    staging.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=staging, prefix=".export-", suffix=".tar") as fh:
        for chunk in archive.chunks:
            fh.write(chunk)
        fh.flush()
        fh.seek(0)
        upload = File(fh, name=archive.filename)
        return modelstore.upload_version(run.team, user, name, upload,
                                         description or f"run {run.pk} ({run.name}), {export.archive_stem}")
