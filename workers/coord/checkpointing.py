"""A run's checkpoints (workers/io/checkpoint.py holds the folder layout): when one is
due, saving one (the trainer's state and weights, and the controller's state in
state.pt), a SIGTERM's checkpoint-and-stop, and restoring from one on --resume.

state.pt is plain data (lists, dicts, numbers, strings, tensors) so that
torch.load(weights_only=True) reads it back: the data position (row order, position,
rows to redo), the RNG states, the run's totals, its times and the length ranker."""
from __future__ import annotations

import asyncio
import json
import logging
import pickle
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from workers.coord.generation import Fleet
from workers.coord.length_ranker import LengthRanker
from workers.coord.rows import RowSource
from workers.coord.step_metrics import RunResult
from workers.coord.trainer_work import TrainerWork
from workers.io.checkpoint import CheckpointInfo, IncompleteCheckpoint, require_trainer_shards, save_checkpoint
from workers.spec import RunSpec, model_dtype
from workers.weights.files import WeightFile, iter_weight_file
from workers.weights.sync import combine_digests, legacy_tensors_checksum, tensor_digest, tensors_checksum

logger = logging.getLogger(__name__)


def plain_rng(state: tuple) -> list:
    """random.Random.getstate() as lists (torch.load(weights_only=True) reads them back)."""
    version, internal, gauss = state
    return [version, list(internal), gauss]


def rng_tuple(state: list) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def plain_numpy_rng(state: tuple) -> list:
    name, keys, pos, has_gauss, cached = state
    return [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]


def numpy_rng_tuple(state: list) -> tuple:
    import numpy as np

    name, keys, pos, has_gauss, cached = state
    return (name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)


@dataclass
class CheckpointParts:
    """What a checkpoint holds and where it goes: the run's spec, folder (``out``),
    totals (``result``) and stop event; its data position and RNG (``rows``), length
    ranker, trainer and trainer time (``work``), generation time so far (``gen_busy()``),
    the engines (``fleet``, checked on resume), the checkpoint resumed from (``resume``)
    and ``on_checkpoint(step, version, path)``, called after each save."""
    spec: RunSpec
    out: Path
    result: RunResult
    stop: asyncio.Event
    rows: RowSource
    ranker: LengthRanker
    work: TrainerWork
    gen_busy: Callable[[], float]
    fleet: Fleet
    resume: Optional[CheckpointInfo] = None
    on_checkpoint: Optional[Callable[[int, int, str], None]] = None


class Checkpointer:
    """Checkpoints of one run (``run``: the parts a checkpoint holds, ``CheckpointParts``).

    ``first_step``: the first step this process trains (after a restored checkpoint's);
    ``seconds_before`` and ``gen_busy_before``: training and generation time before it."""

    def __init__(self, run: CheckpointParts):
        self.run = run
        self.requested = False  # request_stop (SIGTERM): save after the step in progress, then stop
        self.first_step = 1
        self.seconds_before = 0.0  # training time before the resumed checkpoint
        self.gen_busy_before = 0.0

    def due(self, step: int) -> bool:
        every = self.run.spec.trainer.checkpoint_every
        return bool(every) and step % every == 0

    def request_stop(self) -> None:
        """SIGTERM: finish the step in progress, save a checkpoint after it (whatever
        trainer.checkpoint_every says) and stop; a second request, or one before any step
        was trained here, stops at once."""
        if self.requested or self.run.result.steps < self.first_step:
            # asked twice, or nothing trained since the start (or the resumed checkpoint)
            self.run.stop.set()
        self.requested = True

    async def after_step(self, step: int, t_start: float, unfinished: list[dict]) -> None:
        """Save a checkpoint after ``step`` if the spec asks for one now (workers/io/checkpoint.py),
        or a SIGTERM did; after the latter, stop. ``unfinished``: rows drawn but not trained
        on (in flight, scored but not batched); a resumed run generates them first, so no
        prompt is skipped."""
        run = self.run
        on_request = self.requested
        if not (self.due(step) or on_request):
            return
        import torch

        # Everything captured now, in the loop's thread: generation goes on while the
        # files are written.
        trainer = run.work.trainer
        state = self.state(step, trainer.version, time.time() - t_start, unfinished)

        def write(folder: Path) -> None:
            trainer.save_state(str(folder / "trainer"))
            # Every rank's shard must be here before the checkpoint is published as complete.
            self.require_trainer_state(folder / "trainer")
            torch.save(state, folder / "state.pt")
            trainer.save(str(folder / "model"))

        meta = {"version": trainer.version, "weights_checksum": tensors_checksum(trainer.state_dict())}
        try:
            info = await asyncio.to_thread(save_checkpoint, run.out, step, write, meta)
        except IncompleteCheckpoint as exc:  # nothing published; training goes on without it
            logger.warning("checkpoint step-%d not saved: %s", step, exc)
            if on_request:
                run.stop.set()
            return
        if run.on_checkpoint is not None:
            try:
                await asyncio.to_thread(run.on_checkpoint, step, info.version, str(info.path))
            except Exception as exc:  # the checkpoint is on disk; the platform just does not know
                logger.warning("could not report checkpoint step-%d: %s", step, exc)
        if on_request:
            logger.info("stopping after step %d: checkpoint saved in %s", step, info.path)
            run.stop.set()

    def state(self, step: int, version: int, seconds: float, unfinished: list[dict]) -> dict:
        """The controller's part of a checkpoint (state.pt), as plain data (lists, dicts,
        numbers, strings, one tensor): torch.load(weights_only=True) reads it back."""
        import numpy as np
        import torch

        run = self.run
        r = run.result
        return {
            "step": step, "version": version,
            "rows": run.rows.state(unfinished),
            "rng": {"controller": plain_rng(run.rows.rng.getstate()), "python": plain_rng(random.getstate()),
                    "numpy": plain_numpy_rng(np.random.get_state()), "torch": torch.get_rng_state()},
            "result": {"steps": r.steps, "trained_samples": r.trained_samples, "trained_tokens": r.trained_tokens,
                       "staleness_max": r.staleness_max, "dropped_stale": r.dropped_stale,
                       "dropped_uniform": r.dropped_uniform, "trained_groups": r.trained_groups,
                       "accuracy_before": r.accuracy_before},
            "seconds": seconds, "trainer_busy_s": run.work.busy_s,
            "gen_busy_s": run.gen_busy(),
            # plain data copied here, on the loop: pickling the ranker object in the writer
            # thread while the loop goes on learning fails ("deque mutated during iteration")
            "ranker": run.ranker.state_dict(),
        }

    def require_trainer_state(self, folder: Path) -> None:
        """Every file of the trainer's state in ``folder``, or ``IncompleteCheckpoint``."""
        missing_files = getattr(self.run.work.trainer, "missing_state_files", None)  # the pipeline trainer's own
        if missing_files is None:
            require_trainer_shards(folder, *self.trainer_world())
        elif missing := missing_files(str(folder)):
            raise IncompleteCheckpoint(f"{folder} lacks the pipeline trainer's {', '.join(missing)}")

    def trainer_world(self) -> tuple[int, int, bool]:
        """(data-parallel ranks, ZeRO stage, bf16): what names the trainer's checkpoint files."""
        spec = self.run.spec
        return getattr(self.run.work.trainer, "world", 1), spec.trainer.zero_stage, model_dtype(spec) == "bfloat16"

    def restore(self, info: CheckpointInfo) -> None:
        """Trainer (weights, optimiser, version) and controller state from a checkpoint."""
        import torch

        self.require_trainer_state(info.path / "trainer")  # refused, not half-loaded
        self.run.work.trainer.load_state(str(info.path / "trainer"))
        # Plain tensors, lists, dicts, numbers and strings only: nothing in a checkpoint
        # folder runs code when loaded.
        try:
            state = torch.load(info.path / "state.pt", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise RuntimeError(f"{info.path / 'state.pt'} holds pickled objects (a checkpoint of an older FluxRL) "
                               f"and is not loaded: start the run again without --resume ({exc})") from None
        self.load_state(state)

    def load_state(self, state: dict) -> None:
        """The controller state a checkpoint saved (``state``), restored into the run."""
        import numpy as np
        import torch

        run = self.run
        run.rows.load_state(state["rows"])
        run.rows.rng.setstate(rng_tuple(state["rng"]["controller"]))
        random.setstate(rng_tuple(state["rng"]["python"]))
        np.random.set_state(numpy_rng_tuple(state["rng"]["numpy"]))
        torch.set_rng_state(state["rng"]["torch"])
        for key, value in state["result"].items():
            setattr(run.result, key, value)
        run.ranker.load_state_dict(state["ranker"])
        self.first_step = state["step"] + 1
        self.seconds_before = state["seconds"]
        run.work.busy_s = state["trainer_busy_s"]
        self.gen_busy_before = state["gen_busy_s"]

    async def note_resume(self, weights: WeightFile) -> None:
        """Say where the run resumes, and record that the engines hold the checkpoint's
        weights (checksums of what each engine loaded) in resume.json. ``weights``: the
        trainer's, as a file (hashed a tensor at a time)."""
        from safetensors.torch import load_file

        run = self.run
        info = run.resume
        loaded = await asyncio.to_thread(
            lambda: combine_digests({name: tensor_digest(t) for name, t in iter_weight_file(weights.path)}))
        engines = [await e.weights_checksum() for e in run.fleet.engines]
        recorded = info.meta.get("weights_checksum")
        if recorded is None:  # a checkpoint from before per-tensor digests: its own checksum (all in memory)
            recorded, trainer = info.meta.get("weights_sha256"), legacy_tensors_checksum(load_file(weights.path))
        else:
            trainer = loaded
        record = {"from_step": info.step, "version": run.work.trainer.version, "checkpoint": str(info.path),
                  "checkpoint_sha256": recorded, "trainer_sha256": trainer,
                  "engine_sha256": engines, "resumed_at": time.time()}
        (run.out / "resume.json").write_text(json.dumps(record, indent=2))
        same = trainer == recorded and all(e == loaded for e in engines)
        logger.log(logging.INFO if same else logging.WARNING,
                   "resuming from %s (step %d, policy version %d); weights %s", info.path, info.step,
                   run.work.trainer.version, "match the checkpoint" if same else "DIFFER from the checkpoint")
        if not same:
            raise RuntimeError(f"the weights loaded from {info.path} do not match its checksum")
