"""What a schedule (sync_schedule.py, async_schedule.py) works with: the parts of a run
the Controller hands it, each named, rather than the Controller itself."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from workers.coord.checkpointing import Checkpointer
from workers.coord.generation import Fleet, Sample
from workers.coord.step_metrics import RunResult
from workers.coord.trainer_work import TrainerWork
from workers.rollout.staleness import StalenessGate
from workers.spec import RunSpec


@dataclass
class ScheduleParts:
    """- ``rows``: the training rows in order (``RowSource.draw``);
    - ``fleet``: the engines that generate and score groups;
    - ``work``: the trainer (``work.trainer``) and trainer work run in a thread;
    - ``checkpoints``: when one is due, and saving it after a step;
    - ``train_on(groups, step, t_start, stats=None)``: the training step, its weight
      update and report (``Controller.train_on``);
    - ``score(row, completion)``: a sample's scoring after a barrier (``Controller._score``);
    - ``out_of_time(t_start)``: the run stops (stop.max_minutes or asked to);
    - ``stop``, ``fail(error)``: the run's stop event, and failing the run with an error;
    - ``gate``: admission (``StalenessGate``); ``result``: the run's totals (dropped groups)."""
    spec: RunSpec
    rows: Iterator[dict]
    fleet: Fleet
    work: TrainerWork
    checkpoints: Checkpointer
    train_on: Callable[..., Awaitable[None]]
    score: Callable[..., Awaitable[Sample]]  # (row, completion)
    out_of_time: Callable[[float], bool]
    stop: asyncio.Event
    fail: Callable[[BaseException], None]
    gate: StalenessGate
    result: RunResult

