"""Model folders a team uploads (a policy to start from, a reward model), stored like
datasets: checked, then written once as an immutable, checksummed version that a run
spec names as ``model:<name>[@<version>]`` in ``model.path`` or ``reward.model.path``.

An upload is an archive (.tar, .tar.gz/.tgz or .zip) of a Hugging Face folder. It is read
member by member, never extracted as a whole: only regular files with plain relative
names, only the kinds of file a folder needs (safetensors weights, JSON config and
tokenizer files, a SentencePiece model, text), within a size and a count limit. Pickled
weights (``.bin``, ``.pt``, ...) are refused, since loading them runs code, and so is
Python code (nothing is loaded with ``trust_remote_code``). Refused uploads leave nothing
behind. The worker loads the stored folder like any other (its own checks: a one-label
classifier for a reward model, the tokenizer and chat template for a policy)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tarfile
import tempfile
import zipfile
from pathlib import Path

from django.conf import settings
from django.db import transaction

from fluxrl.errors import TooLarge, field_error
from fluxrl.validation import safe_upload_name
from fluxrl.versioned import check_name, find_version, next_version_number

from .models import StoredModel, StoredModelVersion

MAX_FILES = 256
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")  # one path part; no leading dot
ALLOWED_SUFFIXES = {".json", ".safetensors", ".txt", ".model", ".jinja", ".md", ".tiktoken"}
ALLOWED_PLAIN = {"LICENSE", "README", "NOTICE"}  # files without a suffix
PICKLED = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".h5", ".msgpack", ".npz", ".gguf"}
KIND_BY_HEAD = {"ForCausalLM": StoredModelVersion.Kind.CAUSAL_LM,
                "LMHeadModel": StoredModelVersion.Kind.CAUSAL_LM,  # GPT-2's name for it
                "ForSequenceClassification": StoredModelVersion.Kind.SEQUENCE_CLASSIFICATION}
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")


def max_model_bytes() -> int:
    return settings.FLUXRL_MAX_MODEL_BYTES


def store_root() -> Path:
    """Where versions live: not under FLUXRL_DATA_DIR/models (a model root any team may
    name by path), so only the owning team's ``model:`` references reach them."""
    return Path(settings.FLUXRL_DATA_DIR) / "team-models"


def _refuse(message: str):
    return field_error("file", message)


# --- reading an archive ----------------------------------------------------------------

@contextlib.contextmanager
def _members(path: Path, display: str):
    """The archive, open: (name, size, open()) per regular file; anything else is refused by name."""
    if zipfile.is_zipfile(path):
        _zip_entries(path)  # before ZipFile reads the whole central directory
        with zipfile.ZipFile(path) as archive:
            members = []
            for seen, info in enumerate(archive.infolist()):
                _count(seen)
                if info.is_dir():
                    continue
                if ((info.external_attr >> 16) & 0o170000) not in (0, 0o100000):  # a symlink or device in a zip
                    raise _refuse(f"{info.filename}: not a regular file (links and devices are refused)")
                members.append((info.filename, info.file_size, lambda i=info: archive.open(i)))
            yield members
        return
    try:
        archive = tarfile.open(path, "r:*")
    except tarfile.TarError:
        raise _refuse(f"{display} is not a .tar, .tar.gz or .zip archive") from None
    with archive:
        members = []
        for seen, info in enumerate(archive):  # header by header: a bomb of empty members stops at MAX_FILES
            _count(seen)
            if info.isdir():
                continue
            if not info.isfile():
                raise _refuse(f"{info.name}: not a regular file (links and devices are refused)")
            members.append((info.name, info.size, lambda i=info: archive.extractfile(i)))
        yield members


def _zip_entries(path: Path) -> None:
    """The entry count a zip's end record declares (the last 64 KiB hold it), refused past
    MAX_FILES before the central directory is read."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        fh.seek(max(0, size - 65557))
        tail = fh.read()
    end = tail.rfind(b"PK\x05\x06")
    if end < 0 or end + 22 > len(tail):
        raise _refuse("the zip archive has no end record")
    entries = int.from_bytes(tail[end + 10:end + 12], "little")
    if entries >= MAX_FILES:  # 0xFFFF (zip64) included: a model folder needs neither
        raise _refuse(f"the archive holds more than {MAX_FILES} files")


def _count(seen: int) -> None:
    """Entries (folders too) before this one: at most MAX_FILES."""
    if seen >= MAX_FILES:
        raise _refuse(f"the archive holds more than {MAX_FILES} files")


def _clean_names(names: list[str]) -> dict[str, str]:
    """Member name -> its name in the stored folder: a single top-level folder every
    member shares is dropped; a name that is absolute, climbs (``..``), hides (``.x``) or
    holds other characters is refused."""
    parts = {}
    for name in names:
        split = [p for p in name.split("/") if p not in ("", ".")]  # "./config.json" (tar -C dir .) is config.json
        if name.startswith("/") or "\\" in name or not split or not all(_NAME.fullmatch(p) for p in split):
            raise _refuse(f"{name!r}: a file name must be relative, of letters, digits, '.', '_' and '-', "
                          "with no part starting with '.' (no '..', no hidden files)")
        parts[name] = split
    tops = {p[0] for p in parts.values()}
    strip = len(tops) == 1 and all(len(p) > 1 for p in parts.values())
    return {name: "/".join(p[1:] if strip else p) for name, p in parts.items()}


def _check_kind(name: str) -> None:
    leaf = name.rsplit("/", 1)[-1]
    suffix = Path(leaf).suffix.lower()
    if suffix in PICKLED:
        raise _refuse(f"{name}: pickled weights run code when they are loaded; save the model with "
                      "safe_serialization=True (model.safetensors) and upload that")
    if suffix == ".py":
        raise _refuse(f"{name}: custom model code is not run (FluxRL loads models without trust_remote_code)")
    if suffix not in ALLOWED_SUFFIXES and leaf not in ALLOWED_PLAIN:
        raise _refuse(f"{name}: not a file a model folder needs (allowed: {', '.join(sorted(ALLOWED_SUFFIXES))})")


def _read_config(folder: Path) -> tuple[str, str]:
    """(architecture, kind) from config.json."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _refuse("the archive has no config.json at its top level: upload a Hugging Face model folder") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise _refuse(f"config.json is not JSON: {exc}") from None
    archs = config.get("architectures") if isinstance(config, dict) else None
    if not (isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str)):
        raise _refuse("config.json must name one architecture (\"architectures\": [\"...ForCausalLM\"])")
    kind = next((k for head, k in KIND_BY_HEAD.items() if archs[0].endswith(head)), None)
    if kind is None:
        raise _refuse(f"config.json: {archs[0]} is neither a causal LM (*ForCausalLM: a policy for model.path) nor "
                      "a classifier (*ForSequenceClassification: a reward model for reward.model.path)")
    return archs[0], kind


def _check_weights(folder: Path, files: list[str]) -> None:
    weights = [f for f in files if f.endswith(".safetensors")]
    if not weights:
        raise _refuse("the archive has no .safetensors weights")
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            raise _refuse("model.safetensors.index.json has no weight_map") from None
        missing = sorted(s for s in shards if s not in files)
        if missing:
            raise _refuse(f"model.safetensors.index.json names shards the archive lacks: {', '.join(missing)}")


def _unpack(upload_path: Path, display: str, into: Path) -> list[list]:
    """The archive's files written into ``into``: [name, bytes, sha256] each, by name."""
    with _members(upload_path, display) as members:
        return _write(members, into)


def _write(members, into: Path) -> list[list]:
    limit, total, found = max_model_bytes(), 0, []
    names = _clean_names([m[0] for m in members])
    if len(set(names.values())) != len(names):
        raise _refuse("the archive holds the same file name twice")
    for name, size, opener in members:
        stored = names[name]
        _check_kind(stored)
        total += size
        if total > limit:
            raise TooLarge(f"The model's files take more than {limit} bytes; the limit is {limit} bytes "
                           "(FLUXRL_MAX_MODEL_MB).", fields={"file": "too large"})
        target = into / stored
        target.parent.mkdir(parents=True, exist_ok=True)
        digest, written = hashlib.sha256(), 0
        with opener() as src, open(target, "xb") as dst:
            while chunk := src.read(1 << 20):
                written += len(chunk)
                if written > size or total - size + written > limit:  # a header that lied about the size
                    raise _refuse(f"{name}: more bytes than its header says")
                digest.update(chunk)
                dst.write(chunk)
        os.chmod(target, 0o444)
        found.append([stored, written, digest.hexdigest()])
    return sorted(found)


def _manifest_sha256(files: list[list]) -> str:
    h = hashlib.sha256()
    for name, size, sha in files:
        h.update(f"{name}\0{size}\0{sha}\n".encode())
    return h.hexdigest()


# --- storing and finding versions --------------------------------------------------------

def upload_version(team, user, name: str, upload, description: str = "") -> StoredModelVersion:
    """Check an uploaded archive (a Django UploadedFile) and store its folder as the next
    version of the team's model ``name`` (created if new)."""
    check_name(name)
    limit = max_model_bytes()
    if upload.size > limit:
        raise TooLarge(f"The archive is {upload.size} bytes; the limit is {limit} bytes (FLUXRL_MAX_MODEL_MB).",
                       fields={"file": "too large"})
    display = safe_upload_name(upload.name)
    if not display.lower().endswith(ARCHIVE_SUFFIXES):
        raise _refuse(f"{display}: upload the model folder as a .tar, .tar.gz or .zip archive")
    root = store_root()
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".upload-"))
    try:
        archive = staging / "archive"
        with open(archive, "wb") as fh:
            for chunk in upload.chunks():
                fh.write(chunk)
        folder = staging / "folder"
        folder.mkdir()
        files = _unpack(archive, display, folder)
        archive.unlink()
        names = [f[0] for f in files]
        architecture, kind = _read_config(folder)
        _check_weights(folder, names)
        return _add_version(team, user, name, folder, files, architecture, kind, display, description)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@transaction.atomic
def _add_version(team, user, name, folder: Path, files, architecture, kind, source_name, description):
    model, _ = StoredModel.objects.get_or_create(team=team, name=name,
                                                 defaults={"created_by": user, "description": description})
    model = StoredModel.objects.select_for_update().get(pk=model.pk)  # serializes version numbers
    number = next_version_number(model)
    sha256 = _manifest_sha256(files)
    relative = Path("team-models") / str(team.id) / str(model.id) / f"v{number}-{sha256[:12]}"
    final = Path(settings.FLUXRL_DATA_DIR) / relative
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(folder, final)  # one rename: readers never see a half-written folder
    return StoredModelVersion.objects.create(
        model=model, version=number, folder=str(relative), sha256=sha256, size_bytes=sum(f[1] for f in files),
        files=files, architecture=architecture, kind=kind, source_name=source_name, created_by=user)


def get_version(team, ref: str, field: str = "model") -> StoredModelVersion:
    """The team's model version named by 'name@version' (or the newest for 'name')."""
    return find_version(StoredModelVersion.objects.select_related("model"), "model", team, ref, field)
