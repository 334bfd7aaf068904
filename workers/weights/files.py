"""Weights of any size through the RPC path: a state dict written once per version as a
safetensors file, sent to an engine server in bounded chunks, spooled to disk there and
read by vLLM's workers one tensor at a time.

No step holds the model as one buffer: the trainer's side writes the file tensor by
tensor (safetensors' own writer), the wire carries chunks of at most
:func:`chunk_bytes` (``FLUXRL_WEIGHT_CHUNK_MB``, never over the wire's blob cap), the
engine server appends them to a file of its own (:class:`WeightSpool`, whose size caps
come from the model folder it serves and the disk's free space), and the engine reads
tensors from that file lazily (:func:`iter_weight_file`). So a model over
``FLUXRL_WIRE_MAX_BLOB_MB`` (about 1.07 B parameters in float32) updates like any other.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional, Protocol

from workers.io.lifetime import pid_alive, pid_namespace

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CHUNK_ENV = "FLUXRL_WEIGHT_CHUNK_MB"
DEFAULT_CHUNK_MB = 32
# a received state dict may be the model folder's weights in a wider dtype (bf16 on disk,
# float32 trained) with a tied head written out: at most this many times the folder's bytes
SPOOL_SIZE_FACTOR = 4
SPOOL_SLACK_BYTES = 64 << 20  # safetensors header, buffers
DISK_MARGIN_BYTES = 256 << 20  # left free on the spool's disk


def chunk_bytes() -> int:
    """Bytes per chunk on the wire: ``FLUXRL_WEIGHT_CHUNK_MB`` (default 32), never over
    the wire's blob cap (``FLUXRL_WIRE_MAX_BLOB_MB``), at least 64 KiB."""
    from workers.io.wire import max_blob_bytes

    wanted = int(float(os.environ.get(CHUNK_ENV, DEFAULT_CHUNK_MB)) * (1 << 20))
    return max(64 << 10, min(wanted, max_blob_bytes()))


# model.lora: a weight file of a LoRA adapter carries PEFT's adapter_config (JSON) under this
# key of its safetensors header; the engine's worker serves such a file as a vLLM LoRA
ADAPTER_CONFIG_KEY = "fluxrl_adapter_config"


@dataclass(frozen=True)
class WeightFile:
    """A state dict as a safetensors file on this host (its tensors in the trainer's names).
    ``identity``: (device, inode) of the file as it was checked (:func:`local_weight_file`,
    a spool's own file); a reader then opens the path again and reads only that file
    (:func:`held_weight_file`), so nothing swapped in at the path after the check is read."""
    path: str
    size: int
    identity: Optional[tuple[int, int]] = field(default=None, compare=False)


def write_weight_file(state: dict[str, "torch.Tensor"], path: str,
                      metadata: Optional[dict[str, str]] = None) -> WeightFile:
    """Write ``state`` as a safetensors file at ``path`` (atomically: a reader never sees
    half a file). ``metadata``: header entries (a LoRA adapter's config, ``ADAPTER_CONFIG_KEY``)."""
    from safetensors.torch import save_file

    partial = f"{path}.partial"
    save_file(savable_tensors(state), partial, metadata=metadata or None)
    os.replace(partial, path)
    return WeightFile(path, os.path.getsize(path))


class WeightWriter(Protocol):
    """What a trainer gives the rollout engines: its policy's weights written as a
    safetensors file at ``path`` (with model.lora: the adapter alone, its config in the
    header under ``ADAPTER_CONFIG_KEY``). None where this process does not hold them (a
    trainer group on a node other than the coordinator's)."""

    def write_weight_file(self, path: str) -> Optional[WeightFile]: ...


def trainer_weight_file(trainer: WeightWriter, folder: str, version: int) -> WeightFile:
    """The trainer's policy weights as a file in ``folder`` (``weights-v<version>``)."""
    path = os.path.join(folder, f"weights-v{version}.safetensors")
    written = trainer.write_weight_file(path)
    if written is None:
        raise RuntimeError("this trainer holds no copy of the policy's weights here: the coordinator's node writes "
                           "them")
    return written


def weight_file_metadata(source: "str | WeightFile") -> dict[str, str]:
    """A safetensors file's header metadata (empty when it has none); a WeightFile with an
    identity: only if the path still names that file (:func:`held_weight_file`)."""
    from safetensors import safe_open

    with held_weight_file(source) as path, safe_open(path, framework="pt") as f:
        return dict(f.metadata() or {})


def model_state_bytes(model_path: str, dtype: str) -> int:
    """The bytes of a model folder's full weights in ``dtype`` (safetensors headers read,
    no tensor; tied weights stored once count once); other weight files by size:
    ``weights/model_bytes``, the model's parameters (a full update sends these, and a tied
    head's copy)."""
    from safetensors import safe_open

    width = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)
    names = sorted(os.listdir(model_path))
    # One copy of the weights: a sharded folder's index names its shards (a folder may also ship
    # a consolidated file, or pickled copies beside safetensors, or training_args.bin)
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            shards = sorted(set(json.load(fh).get("weight_map", {}).values()))
    else:
        shards = [n for n in names if n.endswith(".safetensors")]
    if not shards:  # pickled weights only: their file sizes
        return sum(os.path.getsize(os.path.join(model_path, n)) for n in names
                   if n.startswith("pytorch_model") and n.endswith(".bin") or n.endswith((".pt", ".pth")))
    total = 0
    for name in shards:
        with safe_open(os.path.join(model_path, name), framework="pt") as f:
            for key in f.keys():
                count = 1
                for dim in f.get_slice(key).get_shape():
                    count *= dim
                total += count * width
    return total


def savable_tensors(state: dict[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    """A HF state dict as safetensors takes it: on the host, contiguous, and tensors that
    share storage (a tied embedding and head) cloned, since safetensors refuses shared
    ones and the engine's loader expects both names."""
    seen: set[int] = set()
    tensors = {}
    for name, t in state.items():
        t = t.detach().to("cpu")
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if ptr in seen else t.contiguous()
        seen.add(ptr)
    return tensors


def iter_weight_file(source: "str | WeightFile") -> Iterator[tuple[str, "torch.Tensor"]]:
    """(name, tensor) pairs read one at a time from a safetensors file (memory-mapped: only
    the tensor in hand is in memory); a WeightFile with an identity: only if the path still
    names that file (:func:`held_weight_file`)."""
    from safetensors import safe_open

    with held_weight_file(source) as path, safe_open(path, framework="pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def _fd_path(fd: int) -> str:
    """A path that opens the file behind ``fd`` itself (not whatever its name now links to)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(folder):
            return f"{folder}/{fd}"
    raise SpoolError("no /proc/self/fd or /dev/fd to read a checked weight file through its descriptor")


@contextlib.contextmanager
def held_weight_file(source: "str | WeightFile") -> Iterator[str]:
    """A path to read ``source`` by. A plain path, or a WeightFile without an identity, is
    yielded as it is. A WeightFile with one is opened once (no link followed at its last
    step), and refused (SpoolError) unless that descriptor is the very file that was checked
    (same device and inode, a regular file, the same size); what is yielded then reads that
    descriptor's file (``/proc/self/fd/N``), whatever is put at the path meanwhile. The
    check and the read are in different processes (an engine server checks, vLLM's workers
    read), so the identity travels with the path and is checked again where it is read."""
    import stat

    if isinstance(source, str) or source.identity is None:
        yield source if isinstance(source, str) else source.path
        return
    try:
        fd = os.open(source.path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise SpoolError(f"weight file {source.path!r} is no longer the file that was checked: "
                         f"{exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != tuple(source.identity) or not stat.S_ISREG(st.st_mode) \
                or st.st_size != source.size:
            raise SpoolError(f"weight file {source.path!r} is no longer the file that was checked (another file "
                             "was put at its path): not loaded")
        yield _fd_path(fd)
    finally:
        os.close(fd)


def read_chunks(path: str, size: Optional[int] = None) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of a file in chunks of :func:`chunk_bytes`."""
    size = chunk_bytes() if size is None else size
    with open(path, "rb") as fh:
        offset = 0
        while True:
            data = fh.read(size)
            if not data:
                return
            yield offset, data
            offset += len(data)


def model_folder_weight_bytes(model_path: str) -> int:
    """The bytes of a model folder's weight files (what its state dict is made of)."""
    total = 0
    for name in os.listdir(model_path):
        if name.endswith((".safetensors", ".bin", ".pt", ".pth")):
            total += os.path.getsize(os.path.join(model_path, name))
    return total


class SpoolError(RuntimeError):
    pass


def local_weight_file(path: str, max_bytes: int) -> WeightFile:
    """The weight file a process of this run wrote on this host and named by its path
    instead of sending it (an engine server that sees the same files as its client: a
    same-host update skips the wire and the spool). Taken only if no other user could have
    put it there: an absolute, normalised path without links to a regular ``.safetensors``
    file of this user, in a folder of this user's that no one else may enter (0700, as
    ``tempfile.mkdtemp`` makes the trainer's), at most ``max_bytes``; else SpoolError."""
    import stat

    def refuse(why: str) -> SpoolError:
        return SpoolError(f"weight file {path!r}: {why}")

    if not os.path.isabs(path) or os.path.normpath(path) != path or not path.endswith(".safetensors"):
        raise refuse("not an absolute, normalised path to a .safetensors file")
    folder = os.path.dirname(path)
    try:
        if os.path.realpath(folder) != folder:
            raise refuse("its folder is reached through a link")
        held = os.lstat(folder)
        if not stat.S_ISDIR(held.st_mode) or held.st_uid != os.getuid() or held.st_mode & 0o077:
            raise refuse("its folder is not this user's alone (it must be 0700 and this user's)")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise refuse(exc.strerror or str(exc)) from exc
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise refuse("not a regular file of this user")
    if st.st_size > max_bytes:
        raise refuse(f"{st.st_size / 2**20:.1f} MiB, over the {max_bytes / 2**20:.1f} MiB this engine takes "
                     f"({SPOOL_SIZE_FACTOR}x its model folder's weights)")
    # what was checked is this inode: the loader opens the path again and reads only this file
    return WeightFile(path, st.st_size, (st.st_dev, st.st_ino))


def remove_orphan_spools(folder: Optional[str] = None) -> list[str]:
    """Remove the spool folders (and the partial weights in them) of this user's processes
    that are gone; returns those removed. A folder whose owner is alive, another user's, or
    one made in another PID namespace (a container sharing the folder: its pid means nothing
    here, alive or not) stays. Names: ``fluxrl-weights-<namespace>-<pid>-<random>``."""
    parent = folder or tempfile.gettempdir()
    namespace = str(pid_namespace())
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            rest = entry.name[len(WeightSpool.PREFIX):] if entry.name.startswith(WeightSpool.PREFIX) else ""
            parts = rest.split("-")
            if len(parts) != 3 or parts[0] != namespace or not parts[1].isdigit() \
                    or not entry.is_dir(follow_symlinks=False):
                continue
            pid = parts[1]
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != os.getuid() or pid_alive(int(pid)):
                    continue
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
                log.info("removed the weight spool %s of process %s, which is gone", entry.path, pid)
    return removed


class WeightSpool:
    """The receiving end: chunks of one stream appended to a file of its own, in a private
    folder (0700). A stream must come in order and whole; its announced total is capped
    (``max_bytes``: from the model folder served) and must fit on the disk. A failure is
    kept and raised when the stream is taken (the reader that writes chunks must not die
    of a sender's mistake), and the partial file is removed at once."""

    MAX_OPEN = 2  # streams being received at once (one update, one start)

    PREFIX = "fluxrl-weights-"

    def __init__(self, max_bytes: int, folder: Optional[str] = None):
        self.max_bytes = max_bytes
        remove_orphan_spools(folder)
        # the owner's PID namespace and pid in the name: a server killed outright (SIGKILL, OOM)
        # cannot remove its folder, and the next spool in its namespace removes it for it
        self.folder = tempfile.mkdtemp(prefix=f"{self.PREFIX}{pid_namespace()}-{os.getpid()}-", dir=folder)
        self._lock = threading.Lock()
        self._open: dict[int, dict[str, Any]] = {}  # stream -> {"fh", "path", "total", "written", "error"}

    @classmethod
    def for_model(cls, model_path: str) -> "WeightSpool":
        return cls(SPOOL_SIZE_FACTOR * model_folder_weight_bytes(model_path) + SPOOL_SLACK_BYTES)

    def write(self, stream: int, offset: int, total: int, data: bytes) -> None:
        with self._lock:
            entry = self._open.get(stream)
            if entry is None:
                entry = self._begin(stream, offset, total)
            if entry["error"] is not None:
                return
            try:
                if offset != entry["written"] or total != entry["total"]:
                    raise SpoolError(f"weight stream {stream}: a chunk at byte {offset} of {total}, expected byte "
                                     f"{entry['written']} of {entry['total']} (chunks out of order or lost)")
                if entry["written"] + len(data) > entry["total"]:
                    raise SpoolError(f"weight stream {stream}: more bytes than the {entry['total']} announced")
                entry["fh"].write(data)
                entry["written"] += len(data)
                if entry["written"] == entry["total"]:
                    entry["fh"].close()
            except (OSError, SpoolError) as exc:
                self._fail(entry, exc)

    def _begin(self, stream: int, offset: int, total: int) -> dict[str, Any]:
        entry: dict[str, Any] = {"fh": None, "path": os.path.join(self.folder, f"stream-{stream}.safetensors"), "total": total,
                 "written": 0, "error": None, "identity": None}
        self._open[stream] = entry
        try:
            if len(self._open) > self.MAX_OPEN:
                raise SpoolError(f"weight stream {stream}: {len(self._open) - 1} other streams are still open "
                                 f"(at most {self.MAX_OPEN})")
            if offset != 0:
                raise SpoolError(f"weight stream {stream} began at byte {offset}, not 0")
            if total > self.max_bytes:
                raise SpoolError(f"weight stream {stream}: {total / 2**20:.1f} MiB announced, over the "
                                 f"{self.max_bytes / 2**20:.1f} MiB this engine takes ({SPOOL_SIZE_FACTOR}x its "
                                 "model folder's weights)")
            free = shutil.disk_usage(self.folder).free
            if total + DISK_MARGIN_BYTES > free:
                raise SpoolError(f"weight stream {stream}: {total / 2**20:.1f} MiB do not fit in the "
                                 f"{free / 2**20:.1f} MiB free under {self.folder} (set TMPDIR to a larger disk)")
            entry["fh"] = open(entry["path"], "wb")  # noqa: SIM115 - closed when complete or failed
            # the file this spool writes is the one the engine reads: nothing put at its path instead
            st = os.fstat(entry["fh"].fileno())
            entry["identity"] = (st.st_dev, st.st_ino)
        except (OSError, SpoolError) as exc:
            self._fail(entry, exc)
        return entry

    def _fail(self, entry: dict, exc: BaseException) -> None:
        entry["error"] = str(exc)
        log.warning("%s", exc)
        if entry["fh"] is not None:
            entry["fh"].close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry["path"])

    def take(self, stream: int) -> WeightFile:
        """The complete file of ``stream`` (the caller removes it with :meth:`release`);
        raises SpoolError for a failed or incomplete stream."""
        with self._lock:
            entry = self._open.pop(stream, None)
        if entry is None:
            raise SpoolError(f"weight stream {stream}: no chunk of it arrived")
        if entry["error"] is None and entry["written"] != entry["total"]:
            entry["error"] = f"weight stream {stream}: {entry['written']} of {entry['total']} bytes arrived"
            self._fail(entry, SpoolError(entry["error"]))
        if entry["error"] is not None:
            raise SpoolError(entry["error"])
        return WeightFile(entry["path"], entry["total"], entry["identity"])

    @staticmethod
    def release(weights: WeightFile) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(weights.path)

    def close(self) -> None:
        with self._lock:
            for entry in self._open.values():
                if entry["fh"] is not None:
                    entry["fh"].close()
            self._open.clear()
        shutil.rmtree(self.folder, ignore_errors=True)


