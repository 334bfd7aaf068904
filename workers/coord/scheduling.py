"""Dispatch policies for prompt groups: in which order they start and on which engine.

Pure functions, deterministic, no engines involved. Inputs are the pending groups'
predicted lengths (tokens; e.g. ``LengthRanker.predict`` × group size) and each
engine's current predicted token load (predicted tokens of the groups it is running).

- ``fifo``: arrival order.
- ``random``: a seeded shuffle.
- ``longest_first`` (a simplified relative of StreamRL's skewness-aware dispatch: an
  order and a placement, no engines set aside for the long tail): predicted-long groups
  start first and go to the engine with the least predicted token load, so long ones
  spread over engines and short ones fill in the gaps — LPT (longest processing time
  first) list scheduling, within 4/3 of the optimal makespan. With aging: a group marked
  ``overdue`` (passed over too often, see async_schedule.py) starts before any other, so
  predicted-short groups cannot wait forever behind a stream of longer newcomers.

The length-blind policies (``fifo``, ``random``) must not use per-group predictions, so
they take every group as average-sized: on engines with equal loads that is round robin.
"""
from __future__ import annotations

import random
from typing import Optional, Sequence

POLICIES = ("fifo", "random", "longest_first")


def dispatch_order(policy: str, predicted: Sequence[float], seed: int = 0,
                   overdue: Optional[Sequence[bool]] = None) -> list[int]:
    """Indices into ``predicted`` in the order the groups should start; ``overdue`` groups
    (longest_first's aging) first, in arrival order."""
    order = list(range(len(predicted)))
    if policy == "fifo":
        return order
    if policy == "random":
        random.Random(seed).shuffle(order)
        return order
    if policy == "longest_first":
        late = overdue or [False] * len(predicted)
        # stable: equal predictions keep arrival order
        return sorted(order, key=lambda i: (0, i) if late[i] else (1, -predicted[i]))
    raise ValueError(f"unknown dispatch policy {policy!r}; choose one of {POLICIES}")


def least_loaded(loads: Sequence[float]) -> int:
    """The engine with the smallest load (the lowest index among equals)."""
    return min(range(len(loads)), key=lambda e: (loads[e], e))


def plan_dispatch(policy: str, predicted: Sequence[float], engine_loads: Sequence[float],
                  seed: int = 0, overdue: Optional[Sequence[bool]] = None) -> list[tuple[int, int]]:
    """``(group index, engine)`` pairs in dispatch order.

    Each group goes to the engine least loaded at that point, counting the groups
    already placed: by their predicted tokens (``longest_first``) or as average-sized
    groups (length-blind policies).
    """
    if not engine_loads:
        raise ValueError("no engines to dispatch to")
    order = dispatch_order(policy, predicted, seed, overdue)
    average = sum(predicted) / len(predicted) if predicted else 0.0
    loads = [float(x) for x in engine_loads]
    plan = []
    for i in order:
        engine = least_loaded(loads)
        loads[engine] += predicted[i] if policy == "longest_first" else average
        plan.append((i, engine))
    return plan


class EngineLoads:
    """What each engine has in flight: predicted tokens (``longest_first`` balances these)
    and groups (the length-blind policies balance these, like picking the engine with
    the fewest active requests)."""

    def __init__(self, engines: int):
        self.tokens = [0.0] * engines
        self.groups = [0] * engines

    def pick(self, policy: str) -> int:
        return least_loaded(self.tokens if policy == "longest_first" else self.groups)

    def start(self, engine: int, predicted_tokens: float) -> None:
        self.tokens[engine] += predicted_tokens
        self.groups[engine] += 1

    def finish(self, engine: int, predicted_tokens: float) -> None:
        self.tokens[engine] -= predicted_tokens
        self.groups[engine] -= 1


def plan_tail_migration(running: Sequence[int], tail: int) -> tuple[int, int, int] | None:
    """RLHFuse's long-tail migration, as a balancing rule: once at most ``tail`` requests
    are still running across the engines, and the busiest engine runs at least two more
    than the idlest, move half the difference from the busiest to the idlest (a decode
    step is cheaper per sequence with fewer sequences in it, and an idle engine's share
    of the machine is wasted). Returns (from, to, how many) or None."""
    total = sum(running)
    if len(running) < 2 or total == 0 or total > tail:
        return None
    src = max(range(len(running)), key=lambda i: (running[i], -i))
    dst = min(range(len(running)), key=lambda i: (running[i], i))
    moved = (running[src] - running[dst]) // 2
    return (src, dst, moved) if moved >= 1 else None


class DispatchWindow:
    """The async schedule's look-ahead window of rows not yet started, with aging: a row that
    ``size`` dispatches have passed over is ``overdue`` and starts before any other
    (``dispatch_order``), so no row waits more than about ``size`` dispatches past that."""

    def __init__(self, size: int):
        self.size = size
        self.rows: list = []
        self.passed_over: list[int] = []

    def fill(self, free: int, source) -> None:
        """Top up from the ``source`` iterator to ``free`` + ``size`` rows."""
        while len(self.rows) < free + self.size:
            self.rows.append(next(source))
            self.passed_over.append(0)

    def overdue(self) -> list[bool]:
        return [n >= self.size for n in self.passed_over]

    def take(self, indices: Sequence[int]) -> list:
        """The rows at ``indices`` (in that order), out of the window; the rest age by one."""
        picked = set(indices)
        taken = [self.rows[i] for i in indices]
        self.passed_over = [n + 1 for k, n in enumerate(self.passed_over) if k not in picked]
        self.rows = [r for k, r in enumerate(self.rows) if k not in picked]
        return taken
