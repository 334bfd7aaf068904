"""Checkpoints a run can resume from: ``<out>/checkpoints/step-<N>/``.

A checkpoint is written into a temporary folder next to the others
(``.tmp-step-<N>-<pid>``) and renamed into place once every file is on disk, so a
``step-<N>`` folder is always complete: a process killed while saving leaves a
``.tmp-*`` folder that the next save (or resume) removes. The newest ``keep`` (2)
checkpoints are kept.

What one holds (written by the controller, see ``workers.coord.checkpointing.Checkpointer``):

    meta.json     step, policy version, time, checksum of the weights (written last)
    trainer/      DeepSpeed's own checkpoint: module, optimiser and scheduler states
    state.pt      controller state: data position (row order, position, rows to redo),
                  RNG states (python, numpy, torch, the controller's), run totals, the
                  output-length ranker
    model/        the policy as a Hugging Face folder (vLLM or transformers can load it)
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

FOLDER = "checkpoints"
META = "meta.json"
KEEP = 2
_STEP = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    version: int
    meta: dict


def checkpoints_dir(out: str | Path) -> Path:
    return Path(out) / FOLDER


def _fsync_dir(folder: str | Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Flush the files and the folders under ``folder`` to disk before the rename that
    publishes them (a crash right after the rename must not leave empty files)."""
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(root)


def list_checkpoints(out: str | Path) -> list[CheckpointInfo]:
    """Complete checkpoints under ``out``, oldest first (a folder without a readable
    meta.json is not one)."""
    root = checkpoints_dir(out)
    found = []
    if not root.is_dir():
        return found
    for entry in root.iterdir():
        match = _STEP.fullmatch(entry.name)
        if not match or not entry.is_dir():
            continue
        try:
            meta = json.loads((entry / META).read_text())
        except (OSError, ValueError):
            continue
        found.append(CheckpointInfo(entry, int(match.group(1)), int(meta.get("version", 0)), meta))
    return sorted(found, key=lambda c: c.step)


class IncompleteCheckpoint(RuntimeError):
    """A checkpoint that lacks some trainer rank's DeepSpeed shard (ranks on several nodes
    without storage they share)."""


def trainer_shards(world: int, zero_stage: int, bf16: bool = False) -> list[str]:
    """The files DeepSpeed's ``save_checkpoint(folder, tag="ds")`` writes under
    ``folder/ds`` for ``world`` data-parallel ranks, by DeepSpeed 0.19.8's own naming
    (``DeepSpeedEngine._get_ckpt_name`` / ``_get_rank_zero_ckpt_name``): the module from
    rank 0, or one per rank when ZeRO-3 partitions it; an optimiser shard per rank at
    ZeRO 1-3."""
    if zero_stage >= 3:
        files = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
    else:
        files = ["mp_rank_00_model_states.pt"]
    if zero_stage >= 1:
        prefix = "bf16_" if bf16 else ""
        files += [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
    return files


def missing_trainer_shards(trainer_folder: str | Path, world: int, zero_stage: int, bf16: bool = False) -> list[str]:
    """Which of ``trainer_shards`` this process cannot see in ``trainer_folder/ds``."""
    ds = Path(trainer_folder) / "ds"
    return [name for name in trainer_shards(world, zero_stage, bf16) if not (ds / name).is_file()]


def require_trainer_shards(trainer_folder: str | Path, world: int, zero_stage: int, bf16: bool = False) -> None:
    missing = missing_trainer_shards(trainer_folder, world, zero_stage, bf16)
    if missing:
        raise IncompleteCheckpoint(
            f"{trainer_folder} lacks {len(missing)} of the {world} trainer ranks' DeepSpeed files ({', '.join(missing)}): "
            "ranks on other nodes wrote them to their own disks. A run over several nodes checkpoints and resumes "
            "only with its output folder on storage every node shares")


def latest_checkpoint(out: str | Path) -> Optional[CheckpointInfo]:
    found = list_checkpoints(out)
    return found[-1] if found else None


def save_checkpoint(out: str | Path, step: int, write: Callable[[Path], None], meta: dict,
                    keep: int = KEEP) -> CheckpointInfo:
    """Write a checkpoint atomically: ``write(folder)`` fills a temporary folder, then
    meta.json is added, everything is flushed, and the folder is renamed to
    ``step-<step>``. Older checkpoints past the newest ``keep`` are removed."""
    root = checkpoints_dir(out)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # left by a process killed while saving
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    tmp.mkdir()
    try:
        write(tmp)
        meta = {**meta, "step": step, "saved_at": time.time()}
        (tmp / META).write_text(json.dumps(meta, indent=2))
        _fsync_tree(tmp)
        final = root / f"step-{step}"
        if final.exists():  # saved again at the same step (a resumed run): replace it
            trash = root / f".tmp-old-step-{step}-{os.getpid()}"
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(out)[:-keep] if keep > 0 else []:
        shutil.rmtree(old.path, ignore_errors=True)
    return CheckpointInfo(final, step, int(meta.get("version", 0)), meta)


def truncate_metrics(path: str | Path, step: int) -> int:
    """Drop the points of ``metrics.jsonl`` after ``step`` (they are computed again by
    the resumed run), atomically; returns how many were dropped. An unreadable last line
    (the process was killed mid-write) is dropped too."""
    path = Path(path)
    if not path.exists():
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                point = json.loads(line)
                keep = int(point["step"]) <= step
            except (ValueError, KeyError, TypeError):
                keep = False
            if keep:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
    return dropped


def read_metrics(path: str | Path) -> list[dict]:
    """The points of a metrics.jsonl file (unreadable lines skipped)."""
    points = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    points.append(json.loads(line))
                except ValueError:
                    continue
    except FileNotFoundError:
        pass
    return points
