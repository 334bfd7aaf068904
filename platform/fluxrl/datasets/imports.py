"""save_to_disk folders: the operator's import root (a team reads only its own folder,
symlinks resolved and refused if they lead out) and uploaded .zip/.tar archives of such a
folder, unpacked member by member within the dataset size limit."""
from __future__ import annotations

import os
import re
from pathlib import Path

from django.conf import settings

from fluxrl.archives import clean_name, members, read_chunk
from fluxrl.errors import InvalidInput, TooLarge, field_error

from . import columnar
from .parsing import max_dataset_bytes

MAX_ARCHIVE_FILES = 1024  # save_to_disk writes shards of 500 MB: a few files per split

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
