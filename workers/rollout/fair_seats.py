"""Fair sharing of a shared engine pool's sequence seats (workers/rollout/pool.py): weighted
fair queuing between the runs that want them, work-conserving."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from typing import Hashable, NamedTuple, Optional


# -- fair sharing of an engine's seats -------------------------------------------------------
class _Want(NamedTuple):
    n: int  # seats wanted, at most the grant cap
    order: int  # arrival: the older of two equally deserving waiters goes first
    future: asyncio.Future  # resolved with the seats granted, 1 .. n


class FairSeats:
    """An engine's sequence seats (vLLM's ``max_num_seqs``) shared between runs. Holding a
    seat means being in vLLM's running batch, so seats are the share of every decode step.

    The policy is weighted fair queuing over seats held, by water-filling: every free seat
    goes, one at a time, to the waiting run whose seats held (with those given in this pass)
    divided by its weight is lowest, the oldest waiter first among equals. A seat held is
    seat-time accruing at the same rate for every run, so keeping held/weight level at every
    grant keeps each busy run's seat-time in proportion to its weight. Deficit round robin
    was the alternative; it charges a request its cost when it is sent, and a sequence's
    seat-time is known only when it ends.

    What holds whatever the requests' sizes:

    - a grant never exceeds the engine's seats nor ``max_grant``: a request wanting more
      gets what is free up to its due and asks again for the rest (TenantEngine splits a
      prompt group into pieces that way);
    - a grant is partial rather than waiting for room: a large request never leaves a seat
      idle while it waits, so it blocks nobody, and it is never starved, since a run with
      nothing held is the most deserving there is;
    - a run alone may hold every seat (work-conserving), and nothing running is preempted:
      a seat changes hands when its sequence ends (``release``)."""

    def __init__(self, capacity: int, max_grant: Optional[int] = None):
        self.capacity = capacity
        self.max_grant = max(1, min(capacity, max_grant or capacity))
        self.held: dict[Hashable, int] = collections.defaultdict(int)
        self.weights: dict[Hashable, float] = {}
        self._waiting: dict[Hashable, collections.deque[_Want]] = collections.defaultdict(collections.deque)
        self._arrivals = itertools.count()

    @property
    def used(self) -> int:
        return sum(self.held.values())

    def set_weight(self, key: Hashable, weight: float) -> None:
        self.weights[key] = weight
        self._grant()

    def forget(self, key: Hashable) -> None:
        """A run that left: its waiters fail, its seats are free."""
        for want in self._waiting.pop(key, ()):
            if not want.future.done():
                want.future.cancel()
        self.held.pop(key, None)
        self.weights.pop(key, None)
        self._grant()

    @contextlib.asynccontextmanager
    async def seats(self, key: Hashable, n: int):
        """Up to ``n`` seats while the block runs; yields how many."""
        granted = await self.acquire(key, n)
        try:
            yield granted
        finally:
            self.release(key, granted)

    async def acquire(self, key: Hashable, n: int) -> int:
        """Between 1 and ``min(n, max_grant)`` seats, once the fair order reaches them:
        returns how many. The caller releases each as its sequence ends."""
        if n < 1:
            raise ValueError(f"a request for {n} seats")
        future = asyncio.get_running_loop().create_future()
        want = _Want(min(n, self.max_grant), next(self._arrivals), future)
        self._waiting[key].append(want)
        self._grant()
        try:
            return await future
        except asyncio.CancelledError:
            if want in self._waiting.get(key, ()):
                self._waiting[key].remove(want)
            elif future.done() and not future.cancelled():  # granted as we were cancelled: give them back
                self.release(key, future.result())
            raise

    def release(self, key: Hashable, n: int) -> None:
        if key in self.held:
            self.held[key] = max(0, self.held[key] - n)
        self._grant()

    def _head(self, key: Hashable) -> Optional[_Want]:
        queue = self._waiting.get(key)
        while queue and queue[0].future.done():  # cancelled meanwhile
            queue.popleft()
        return queue[0] if queue else None

    def _grant(self) -> None:
        free = self.capacity - self.used
        given: dict[Hashable, int] = {}  # to the heads, this pass, not yet handed over
        while free > 0:
            best, best_rank = None, None
            for key in list(self._waiting):
                head = self._head(key)
                if head is None:
                    continue
                rank = ((self.held.get(key, 0) + given.get(key, 0)) / self.weights.get(key, 1.0), head.order)
                if best_rank is None or rank < best_rank:
                    best, best_rank = key, rank
            if best is None:
                break
            given[best] = given.get(best, 0) + 1
            free -= 1
            if given[best] == self._waiting[best][0].n:  # that head is whole: the run's next request may follow
                self._hand_over(best, given.pop(best))
        for key, n in given.items():  # the rest: partial grants
            self._hand_over(key, n)

    def _hand_over(self, key: Hashable, n: int) -> None:
        want = self._waiting[key].popleft()
        self.held[key] += n
        want.future.set_result(n)
