"""A synchronous step's tail: while its generation runs, move requests from the busiest
engine to the idlest (``rollout.migrate_tail``) or gather the tail onto one engine
(``rollout.gather_tail``)."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Optional

from workers.coord.scheduling import plan_tail_gathering, plan_tail_migration
from workers.rollout.engine import RolloutEngine
from workers.spec import RunSpec


class TailMover:
    """``migrations``: sequences moved to another engine so far; ``gather_onto``: the
    engine a step's tail is gathered onto, while it is (the fleet finishes handed-off
    sequences there); ``request_ended``: set by the fleet when a sequence's request
    ends. ``engines``: the fleet's live engines during the step."""

    def __init__(self, spec: RunSpec):
        self.spec = spec
        self.migrations = 0
        self.gather_onto: Optional[int] = None
        self.request_ended = asyncio.Event()

    async def _migrate_tail(self, engines: list[RolloutEngine]) -> None:
        """During a synchronous step's generation: when few requests remain, move some
        from the busiest engine to the idlest (``rollout.migrate_tail``)."""
        tail = self.spec.rollout.migrate_tail
        while True:
            plan = plan_tail_migration([len(e.active) for e in engines], tail)
            if plan is not None:
                src, dst, count = plan
                self.migrations += await engines[src].hand_off(count)
                await asyncio.sleep(0.1)  # let the moved requests land before looking again
            await asyncio.sleep(0.02)

    async def _gather_tail(self, engines: list[RolloutEngine]) -> None:
        """During a synchronous step's generation: when few requests remain, move them all
        onto one engine (``rollout.gather_tail``), once; the freed engines' cores then serve
        the inference stage while the tail finishes."""
        tail, capacity = self.spec.rollout.gather_tail, self.spec.rollout.max_num_seqs
        while True:
            self.request_ended.clear()
            running = [len(e.active) for e in engines]
            plan = plan_tail_gathering(running, tail, capacity)
            if plan is not None:
                onto, sources = plan
                self.gather_onto = engines[onto].index
                moved = await asyncio.gather(*(engines[i].hand_off(running[i]) for i in sources))
                self.migrations += sum(moved)
                return
            # the tail shrinks when a request ends: look then (a step's tail may last milliseconds)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.request_ended.wait(), 0.05)

    @contextlib.asynccontextmanager
    async def during(self, engines: list[RolloutEngine]):
        """Around a synchronous step's generation: migrate (``migrate_tail``) or gather
        (``gather_tail``) its tail while it runs."""
        mover = None
        if len(engines) > 1 and (self.spec.rollout.migrate_tail or self.spec.rollout.gather_tail):
            mover = asyncio.create_task(self._migrate_tail(engines) if self.spec.rollout.migrate_tail
                                        else self._gather_tail(engines))
        try:
            yield
        finally:
            if mover is not None:
                mover.cancel()
                await asyncio.gather(mover, return_exceptions=True)
            self.gather_onto = None
