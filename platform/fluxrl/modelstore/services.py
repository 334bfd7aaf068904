"""Model folders a team uploads (a policy to start from, a reward model), stored like
datasets: checked, then written once as an immutable, checksummed version that a run
spec names as ``model:<name>[@<version>]`` in ``model.path`` or ``reward.model.path``.

An upload is an archive (.tar, .tar.gz/.tgz or .zip) of a Hugging Face folder. It is read
member by member, never extracted as a whole: only regular files with plain relative
names, only the kinds of file a folder needs (safetensors weights, JSON config and
tokenizer files, a SentencePiece model, text), within a size and a count limit checked
header by header, before a member's bytes are read; compressed only as its name says.
Pickled weights (``.bin``, ``.pt``, ...) are refused, since loading them runs code, and so
is Python code (nothing is loaded with ``trust_remote_code``). The folder is checked as a
loader reads it: one shard index (model.safetensors.index.json) naming only the archive's
own files, no JSON key that points the loader at other weights or code
(``transformers_weights``, ``auto_map``), each JSON file capped before it is parsed.
Refused uploads leave nothing behind. The worker loads the stored folder like any other (its own checks: a one-label
classifier for a reward model, the tokenizer and chat template for a policy)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from django.conf import settings
from django.db import transaction

from fluxrl.archives import ARCHIVE_SUFFIXES, members
from fluxrl.archives import clean_name as _clean_name
from fluxrl.archives import read_chunk as _read
from fluxrl.errors import TooLarge, field_error
from fluxrl.quotas.services import check_storage
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
INDEX_NAME = "model.safetensors.index.json"  # the one shard index; its shards are the archive's own files
# Keys (anywhere in a folder's JSON) that make transformers or vLLM read other weights or run code.
REFUSED_KEYS = {
    "transformers_weights": "it points the loader at another weights file; the folder's own weights are "
                            "model.safetensors, or shards named in model.safetensors.index.json",
    "auto_map": "it names custom model code (FluxRL loads models without trust_remote_code)",
    "custom_pipelines": "it names custom pipeline code (FluxRL loads models without trust_remote_code)",
    "trust_remote_code": "FluxRL loads models without trust_remote_code",
}
REFUSED_FILES = {"adapter_config.json": "a PEFT adapter loads its base model from wherever the file names; "
                                        "merge the adapter and upload the full model"}
VOCABULARIES = {"tokenizer.json", "vocab.json"}  # stored for the tokenizer, never parsed here


def max_model_bytes() -> int:
    return settings.FLUXRL_MAX_MODEL_BYTES


def store_root() -> Path:
    """Where versions live: not under FLUXRL_DATA_DIR/models (a model root any team may
    name by path), so only the owning team's ``model:`` references reach them."""
    return Path(settings.FLUXRL_DATA_DIR) / "team-models"


def _refuse(message: str):
    return field_error("file", message)


# --- reading an archive ----------------------------------------------------------------

def max_json_bytes() -> int:
    return settings.FLUXRL_MAX_MODEL_JSON_BYTES


class _Budget:
    """What the members declared so far, checked as each header arrives."""

    def __init__(self):
        self.limit, self.declared, self.entries, self.written = max_model_bytes(), 0, 0, 0

    def header(self, name: str, size: int) -> None:
        if self.entries >= MAX_FILES:  # folders count too: a bomb of empty members stops here
            raise _refuse(f"the archive holds more than {MAX_FILES} files")
        self.entries += 1
        self.declared += max(0, size)
        if self.declared > self.limit:
            raise TooLarge(f"The model's files take more than {self.limit} bytes (at {name!r}); the limit is "
                           f"{self.limit} bytes (FLUXRL_MAX_MODEL_MB).", fields={"file": "too large"})


def _members(path: Path, display: str, budget: _Budget):
    return members(path, display, budget, "model", MAX_FILES)


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
    if leaf in REFUSED_FILES:
        raise _refuse(f"{name}: {REFUSED_FILES[leaf]}")


def _parsed_json(name: str) -> bool:
    """A JSON file the platform parses (and caps); vocabularies are only stored."""
    return name.lower().endswith(".json") and name.rsplit("/", 1)[-1] not in VOCABULARIES


def _check_json_size(name: str, size: int) -> None:
    cap = max_json_bytes()
    if _parsed_json(name) and size > cap:
        raise TooLarge(f"{name} is {size} bytes; a model folder's JSON metadata is at most {cap} bytes "
                       "(FLUXRL_MAX_MODEL_JSON_MB)", fields={"file": f"{name} too large"})


def _unpack(upload_path: Path, display: str, into: Path) -> list[list]:
    """The archive's files written into ``into``: [name, bytes, sha256] each, by name. A
    single top-level folder every member shares is dropped."""
    budget, found, parts = _Budget(), [], {}
    for name, size, opener in _members(upload_path, display, budget):
        split = _clean_name(name)
        stored = "/".join(split)
        if stored in parts:
            raise _refuse("the archive holds the same file name twice")
        parts[stored] = split
        _check_kind(stored)
        _check_json_size(stored, size)
        target = into / stored
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            out = open(target, "xb")
        except OSError:  # "a" and "a/b" both in the archive
            raise _refuse(f"{name}: clashes with another file of the archive") from None
        digest, written = hashlib.sha256(), 0
        with opener() as src, out:
            while chunk := _read(src, name):
                written += len(chunk)
                budget.written += len(chunk)
                if written > size or budget.written > budget.limit:  # a header that lied about the size
                    raise _refuse(f"{name}: more bytes than its header says")
                digest.update(chunk)
                out.write(chunk)
        os.chmod(target, 0o444)
        found.append([stored, written, digest.hexdigest()])
    tops = {p[0] for p in parts.values()}
    if len(tops) == 1 and parts and all(len(p) > 1 for p in parts.values()):
        top = tops.pop()
        moved = into.with_name(into.name + ".top")
        os.replace(into / top, moved)
        into.rmdir()
        os.replace(moved, into)
        found = [[name.split("/", 1)[1], size, sha] for name, size, sha in found]
    return sorted(found)



def _load_json(folder: Path, name: str):
    """A parsed JSON file of the folder, its size checked before it is read."""
    path = folder / name
    _check_json_size(name, path.stat().st_size)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise _refuse(f"{name} is not JSON: {exc}") from None
    except RecursionError:
        raise _refuse(f"{name}: nested too deeply") from None


def _refused_key(value) -> str | None:
    """The first key anywhere in a parsed JSON value that would make a loader read other
    weights or run code."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, inner in item.items():
                if key in REFUSED_KEYS:
                    return key
                stack.append(inner)
        elif isinstance(item, list):
            stack.extend(item)
    return None


def _read_config(folder: Path) -> tuple[str, str]:
    """(architecture, kind) from config.json."""
    if not (folder / "config.json").is_file():
        raise _refuse("the archive has no config.json at its top level: upload a Hugging Face model folder")
    config = _load_json(folder, "config.json")
    archs = config.get("architectures") if isinstance(config, dict) else None
    if not (isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str)):
        raise _refuse("config.json must name one architecture (\"architectures\": [\"...ForCausalLM\"])")
    kind = next((k for head, k in KIND_BY_HEAD.items() if archs[0].endswith(head)), None)
    if kind is None:
        raise _refuse(f"config.json: {archs[0]} is neither a causal LM (*ForCausalLM: a policy for model.path) nor "
                      "a classifier (*ForSequenceClassification: a reward model for reward.model.path)")
    return archs[0], kind


def _check_as_loaded(folder: Path, files: list[str]) -> None:
    """The folder as transformers and vLLM read it: no JSON names other weights or code,
    and the one shard index names only files of the archive itself."""
    for name in files:
        if name.endswith(".index.json") and name != INDEX_NAME:  # transformers would read it as a shard index
            raise _refuse(f"{name}: the only shard index read is a top-level {INDEX_NAME}; other index files "
                          "(pytorch_model.bin.index.json, ...) are refused")
    for name in files:
        if _parsed_json(name):
            key = _refused_key(_load_json(folder, name))
            if key:
                raise _refuse(f"{name}: {key!r} is refused: {REFUSED_KEYS[key]}")
    weights = [f for f in files if f.endswith(".safetensors")]
    if not weights:
        raise _refuse("the archive has no .safetensors weights")
    if INDEX_NAME not in files:
        return
    index = _load_json(folder, INDEX_NAME)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
        raise _refuse(f"{INDEX_NAME} has no weight_map of tensor names to shard file names")
    outside = sorted({s for s in weight_map.values() if not _NAME.fullmatch(s)})
    if outside:
        raise _refuse(f"{INDEX_NAME} names shards outside the folder: {', '.join(map(repr, outside))} (a shard is "
                      "a file name of the archive's top level)")
    missing = sorted({s for s in weight_map.values() if s not in weights})
    if missing:
        raise _refuse(f"{INDEX_NAME} names shards the archive lacks: {', '.join(missing)} (a shard is one of its "
                      ".safetensors files)")


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
        _check_as_loaded(folder, names)
        return _add_version(team, user, name, folder, files, architecture, kind, display, description)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@transaction.atomic
def _add_version(team, user, name, folder: Path, files, architecture, kind, source_name, description):
    check_storage(team, sum(f[1] for f in files), len(files), user)  # team's, uploader's, org's; locked until stored
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
