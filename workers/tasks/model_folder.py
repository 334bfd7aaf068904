"""The load-time check every FluxRL loader runs on a model folder before transformers or
vLLM opens it (``check_model_folder``).

transformers joins each ``weight_map`` entry of a shard index to the folder without
checking that it stays inside, and honours ``config.json``'s ``transformers_weights``
(any index file name). A folder whose index names
``../../runs/<id>/out/final_model/model.safetensors`` would load another run's weights.
The platform refuses such uploads; this check also covers folders stored before that
rule, local paths on a worker, and anything edited since. It reads JSON and stats files
only (no weights), so it is cheap enough to run before every load."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

# config.json keys that make a loader read weights other than the folder's own. ``auto_map``
# is refused at upload, not here: FluxRL never passes trust_remote_code, so transformers
# loads its own class or refuses, and many cached hub configs carry the key.
REDIRECT_KEYS = ("transformers_weights",)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf")
MAX_JSON_BYTES = 64 * 1024 * 1024  # an index or a config is kilobytes; this bounds what is parsed here


class UnsafeModelFolder(ValueError):
    """The folder would make a loader read files outside it, or run code; the message names the file."""


def check_model_folder(path) -> str:
    """``path``, after checking that loading it reads only the folder's own files: every shard
    that any ``*.index.json`` names resolves (symlinks followed) inside the folder, every
    weight file in it does too, and ``config.json`` redirects nowhere. Not a folder (a hub
    id resolved elsewhere): returned unchecked. Raises UnsafeModelFolder."""
    folder = Path(path)
    if not folder.is_dir():
        return path
    roots = _roots(folder)
    config_file = folder / "config.json"
    if config_file.is_file():
        config = _json(config_file)
        for key in REDIRECT_KEYS:
            if isinstance(config, dict) and key in config:
                raise UnsafeModelFolder(f"{config_file}: {key!r} is refused (it makes the loader read weights "
                                        "other than this folder's own); remove it")
    if (folder / "adapter_config.json").exists():  # PEFT would load the base model the file names, wherever
        raise UnsafeModelFolder(f"{folder / 'adapter_config.json'}: adapter folders are refused (their base model "
                                "is loaded from elsewhere); merge the adapter and save the full model")
    for index in sorted(folder.glob("*.index.json")):
        data = _json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise UnsafeModelFolder(f"{index}: no weight_map (a shard index maps tensor names to shard files)")
        for shard in sorted({str(s) for s in weight_map.values()}):
            if os.path.isabs(shard) or not _inside(folder / shard, roots):
                raise UnsafeModelFolder(f"{index}: shard {shard!r} is outside the model folder {folder}; a shard "
                                        "index may only name files in its own folder")
    for entry in folder.iterdir():
        if entry.name.endswith(WEIGHT_SUFFIXES) and not _inside(entry, roots):
            raise UnsafeModelFolder(f"{entry}: links outside the model folder {folder}")
    return path


def _roots(folder: Path) -> list[Path]:
    """Where the folder's files may resolve: the folder itself, and for a snapshot in the
    Hugging Face cache (files are links to ../../blobs) that repository's blobs."""
    real = folder.resolve()
    roots = [real]
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        roots.append((real.parent.parent / "blobs").resolve())
    return roots


def _inside(path: Path, roots: list[Path]) -> bool:
    real = path.resolve()
    return any(real == root or real.is_relative_to(root) for root in roots)


def _json(path: Path):
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise UnsafeModelFolder(f"{path}: {size} bytes of JSON; a model folder's metadata is at most "
                                f"{MAX_JSON_BYTES} bytes")
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UnsafeModelFolder(f"{path} is not JSON: {exc}") from None
