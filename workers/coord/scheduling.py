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
- ``skew_aware`` (StreamRL's skewness-aware dispatch): the groups the ranker predicts in
  the longest ``share`` (against the recent predictions, ``LongTailThreshold``) go to the
  long-tail engines, the rest to the bulk engines, each pool balanced by predicted tokens
  as above. A long-tail engine thus runs few sequences at a time (its batch is small, so
  each decode step is quick and the long samples finish sooner) while the bulk engines
  pack the short ones. How many engines serve the long tail comes from their measured
  rates (``split_engines``), and every request carries a vLLM priority (``priority``):
  longer first, with aging, so that none starves in an engine's queue.

The length-blind policies (``fifo``, ``random``) must not use per-group predictions, so
they take every group as average-sized: on engines with equal loads that is round robin.
"""
from __future__ import annotations

import math
import random
from collections import deque
from typing import Optional, Sequence

POLICIES = ("fifo", "random", "longest_first", "skew_aware")
LENGTH_AWARE = ("longest_first", "skew_aware")  # policies that use the ranker's predictions


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
    if policy in LENGTH_AWARE:
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
        loads[engine] += predicted[i] if policy in LENGTH_AWARE else average
        plan.append((i, engine))
    return plan


def plan_skew_aware(predicted: Sequence[float], engine_loads: Sequence[float], long_tail: Sequence[bool],
                    threshold: float, overdue: Optional[Sequence[bool]] = None) -> list[tuple[int, int]]:
    """``(group index, engine)`` pairs in dispatch order for ``skew_aware``: longest first
    (``overdue`` groups before all), a group predicted at or above ``threshold`` on the
    least-loaded engine marked ``long_tail``, any other on the least-loaded bulk engine.
    A pool with no engine (one engine in all, say) hands its groups to the other."""
    if not engine_loads:
        raise ValueError("no engines to dispatch to")
    loads = [float(x) for x in engine_loads]
    long_pool = [e for e in range(len(loads)) if long_tail[e]]
    bulk_pool = [e for e in range(len(loads)) if not long_tail[e]]
    plan = []
    for i in dispatch_order("longest_first", predicted, overdue=overdue):
        pool = long_pool if predicted[i] >= threshold else bulk_pool
        pool = pool or long_pool or bulk_pool
        engine = min(pool, key=lambda e: (loads[e], e))
        loads[engine] += predicted[i]
        plan.append((i, engine))
    return plan


def split_engines(engines: int, long_tokens: float, bulk_tokens: float, long_rate: float, bulk_rate: float) -> int:
    """How many of ``engines`` serve the long tail: the ``k`` in 1..engines-1 that lets both
    pools finish their predicted tokens soonest, ``max(long_tokens / (k·long_rate),
    bulk_tokens / ((engines-k)·bulk_rate))``, where the rates are the measured tokens per
    busy second of one engine in each role (a long-tail engine's is lower: it runs few
    sequences). The smaller ``k`` among equals; 0 with fewer than two engines."""
    if engines < 2:
        return 0
    long_rate, bulk_rate = max(long_rate, 1e-9), max(bulk_rate, 1e-9)

    def makespan(k: int) -> float:
        return max(long_tokens / (k * long_rate), bulk_tokens / ((engines - k) * bulk_rate))

    return min(range(1, engines), key=lambda k: (makespan(k), k))


class LongTailThreshold:
    """Which predicted lengths count as the long tail: the ``1 - share`` quantile of the
    last ``window`` predictions dispatched (the step's own included), so the cut follows
    the ranker as the policy's lengths drift. Also gives a prediction's percentile among
    them, for its vLLM priority."""

    def __init__(self, share: float, window: int = 512):
        if not 0 < share < 1:
            raise ValueError("the long-tail share must be between 0 and 1")
        self.share = share
        self.recent: deque[float] = deque(maxlen=window)

    def observe(self, predictions: Sequence[float]) -> None:
        self.recent.extend(float(p) for p in predictions)

    def threshold(self, pending: Sequence[float] = ()) -> float:
        """The smallest prediction in the longest ⌈share·n⌉ of the recent ones and
        ``pending`` (those about to be dispatched); inf when there are none."""
        values = [*self.recent, *pending]
        if not values:
            return math.inf
        k = max(1, math.ceil(self.share * len(values)))
        return sorted(values, reverse=True)[k - 1]

    def percentile(self, prediction: float) -> float:
        """Share of the recent predictions at or below ``prediction`` (1.0: none yet)."""
        if not self.recent:
            return 1.0
        return sum(1 for p in self.recent if p <= prediction) / len(self.recent)


def priority(sequence: int, percentile: float, aging: int) -> int:
    """A request's vLLM priority (smaller runs first; vLLM breaks ties by arrival): its
    dispatch number, plus up to ``aging`` for a predicted-short one. So a longer group
    dispatched later may overtake it, but only one dispatched fewer than ``aging`` groups
    after it: nothing waits behind more than ``aging`` later arrivals (aging, as a
    deadline that every request reaches)."""
    return int(sequence + round(aging * (1.0 - min(1.0, max(0.0, percentile)))))


class EngineLoads:
    """What each engine has in flight: predicted tokens (``longest_first`` balances these)
    and groups (the length-blind policies balance these, like picking the engine with
    the fewest active requests)."""

    def __init__(self, engines: int):
        self.tokens = [0.0] * engines
        self.groups = [0] * engines

    def pick(self, policy: str) -> int:
        return least_loaded(self.tokens if policy in LENGTH_AWARE else self.groups)

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


def plan_tail_gathering(running: Sequence[int], tail: int, capacity: int) -> tuple[int, list[int]] | None:
    """RLHFuse's tail gathering: once at most ``tail`` requests are still running across the
    engines, and more than one engine runs any, move them all onto the engine running the
    most (the fewest moves), if they fit its ``capacity`` (vLLM's max_num_seqs). Decoding
    a few sequences costs an engine about what one costs, so the tail loses little speed,
    and the engines it leaves are free for the inference stage. Returns (onto, [from, ...])
    or None."""
    total = sum(running)
    busy = [i for i, n in enumerate(running) if n > 0]
    if total == 0 or total > tail or total > capacity or len(busy) < 2:
        return None
    onto = max(busy, key=lambda i: (running[i], -i))
    return onto, [i for i in busy if i != onto]


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
