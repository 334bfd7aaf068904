"""Where a run's time goes: each training step's wall time split into parts that add up
to it (``time/<part>_s``, and ``time/step_s`` for the whole step), reported with the
step's other metrics and drawn on the run page as a stacked bar per step.

A step runs from the end of the previous step's report (the schedule's start, for the
first) to the end of its own weight update. Work overlaps (the engines generate while
the trainer steps in async mode, samples are scored while others still generate), so
each moment is attributed once, along the trainer's critical path: to the first of
these that is under way then

1. the trainer computing (``forward``, ``backward``, ``optimizer``);
2. the weights going to the engines (``weight_update``);
3. an evaluation between steps (``eval``);
4. generation: an engine with a request running (``generation``);
5. scoring: a sample's reward (and inference-stage forwards) being computed (``scoring``);
6. admission held by the staleness gate, in async mode (``gate_wait``);
7. none of them: the coordinator's own work, dispatch, checkpoints (``idle``).

So in async mode generation beside the trainer's step counts as training, and
``generation`` is the time the trainer waited for rollouts. The trainer's time is split
by its own timings of the step (``trainer/backward_s``, ``trainer/optimizer_s``);
``forward`` is the rest of it (packing, the forward passes, the loss, π_prox, moving
the batch to the trainer's processes), so a trainer that reports no split counts all of
its time as ``forward``.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterable, Iterator

PARTS = ("generation", "scoring", "gate_wait", "forward", "backward", "optimizer", "weight_update", "eval", "idle")
# what is under way, first the one that owns the time when several are
ACTIVITIES = ("train", "weight_update", "eval", "generation", "scoring")


def metric(part: str) -> str:
    return f"time/{part}_s"


class TimeBreakdown:
    """Counts what is under way (``begin``/``end``, or ``track``) and adds each interval
    between two changes to the part that owned it. ``clock``: seconds (a fake one in
    tests); ``gate_blocked``: whether admission is held by the staleness gate now."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 gate_blocked: Callable[[], bool] = lambda: False):
        self._clock = clock
        self.gate_blocked = gate_blocked
        self._lock = threading.Lock()  # engine callbacks may come from another thread
        self._active = dict.fromkeys(ACTIVITIES, 0)
        self._seconds = dict.fromkeys(ACTIVITIES + ("gate_wait", "idle"), 0.0)
        self._blocked = False
        self._last = clock()

    def restart(self) -> None:
        """A new first step starts now (the schedule's start): time before it is dropped;
        what is under way stays counted."""
        with self._lock:
            self._last = self._clock()
            self._seconds = dict.fromkeys(self._seconds, 0.0)
            self._blocked = self.gate_blocked()

    def _owner(self) -> str:
        for activity in ACTIVITIES:
            if self._active[activity] > 0:
                return activity
        return "gate_wait" if self._blocked else "idle"

    def _tick(self) -> None:
        """The interval since the last change goes to its owner."""
        now = self._clock()
        self._seconds[self._owner()] += max(0.0, now - self._last)
        self._last = now
        self._blocked = self.gate_blocked()

    def begin(self, activity: str) -> None:
        with self._lock:
            self._tick()
            self._active[activity] += 1

    def end(self, activity: str) -> None:
        with self._lock:
            self._tick()
            # an end without its begin (a request running before watch()) is not counted
            self._active[activity] = max(0, self._active[activity] - 1)

    @contextlib.contextmanager
    def track(self, activity: str) -> Iterator[None]:
        self.begin(activity)
        try:
            yield
        finally:
            self.end(activity)

    def engine_busy(self, busy: bool) -> None:
        """An engine started its first running request (True) or finished its last."""
        (self.begin if busy else self.end)("generation")

    def watch(self, engines: Iterable) -> None:
        """Count the engines' generation (``RolloutEngine.on_busy``)."""
        for engine in engines:
            engine.on_busy = self.engine_busy

    def step(self, trainer_stats: dict) -> dict[str, float]:
        """The step that ends now: ``time/<part>_s`` for each part and ``time/step_s``,
        their sum; the next step starts now."""
        with self._lock:
            self._tick()
            seconds, self._seconds = self._seconds, dict.fromkeys(self._seconds, 0.0)
        train = seconds["train"]
        backward = min(train, max(0.0, float(trainer_stats.get("trainer/backward_s", 0.0))))
        optimizer = min(train - backward, max(0.0, float(trainer_stats.get("trainer/optimizer_s", 0.0))))
        parts = {"generation": seconds["generation"], "scoring": seconds["scoring"],
                 "gate_wait": seconds["gate_wait"], "forward": train - backward - optimizer,
                 "backward": backward, "optimizer": optimizer, "weight_update": seconds["weight_update"],
                 "eval": seconds["eval"], "idle": seconds["idle"]}
        return {**{metric(p): parts[p] for p in PARTS}, "time/step_s": sum(parts.values())}


def summarize(points: list[dict[str, float]]) -> dict[str, float]:
    """Mean seconds per step of each part over steps' ``time/*`` metrics, and the share
    of the step each takes (``<part>_share``); for the bench's tables."""
    if not points:
        return {}
    n = len(points)
    means = {p: sum(pt.get(metric(p), 0.0) for pt in points) / n for p in PARTS}
    step = sum(pt.get("time/step_s", 0.0) for pt in points) / n
    return {"step_s": step, **{f"{p}_s": v for p, v in means.items()},
            **{f"{p}_share": (v / step if step > 0 else 0.0) for p, v in means.items()}}
