"""``schedule.dispatch: skew_aware``: which of the run's engines serve the long tail of
predicted lengths, where the cut between long and bulk predictions lies, and each
role's measured rate (the fleet, generation.py, dispatches by them)."""
from __future__ import annotations

import math
from typing import Optional

from workers.coord.scheduling import LongTailThreshold, split_engines
from workers.rollout.engine import RolloutEngine
from workers.spec import RunSpec


class LongTailRoles:
    """The long-tail engines (``long_tail``: their indices), the cut between long and
    bulk predictions (``long_tail_cut``), the tokens per busy second of one engine of
    each role (``role_rates``) and the groups dispatched so far (``dispatched``, the
    base of their priorities). ``engines``: the fleet's live engines."""

    def __init__(self, spec: RunSpec):
        self.spec = spec
        self.long_tail: set[int] = set()
        self.long_tail_cut = LongTailThreshold(spec.schedule.long_tail.share)
        self.dispatched = 0  # groups dispatched: the base of their priorities
        self.role_rates: dict[str, Optional[float]] = {"long": None, "bulk": None}  # one engine's (EMA)
        self._rate_marks: dict[int, tuple[int, float]] = {}  # engine -> (tokens, busy s) at the last split

    def roles(self, engines: list[RolloutEngine]) -> set[int]:
        """The live engines serving the long tail (none with one engine); chosen again when
        every one of them (or every bulk engine) died, or before the first dispatch."""
        live = {e.index for e in engines}
        self.long_tail &= live
        if len(live) > 1 and (not self.long_tail or self.long_tail == live):
            self.split(engines)
        return self.long_tail

    def split(self, engines: list[RolloutEngine]) -> int:
        """Choose the long-tail engines again (after each trained step, and when an engine
        died): measure each role's tokens per busy second since the last split (an EMA),
        then ``split_engines`` over the recent predictions' long and bulk tokens. The
        long-tail engines are the lowest indices, so an engine keeps its role while the
        split stays. ``long_tail.engines`` fixes the count instead. Returns it."""
        now = {e.index: (e.generated_tokens, e.busy_seconds()) for e in engines}
        for role, members in (("long", self.long_tail), ("bulk", set(now) - self.long_tail)):
            tokens = busy = 0.0
            for i in members & set(self._rate_marks):
                tokens += now[i][0] - self._rate_marks[i][0]
                busy += now[i][1] - self._rate_marks[i][1]
            if busy > 0.5 and tokens > 0:  # enough to measure: per engine of the role
                rate = tokens / busy
                old = self.role_rates[role]
                self.role_rates[role] = rate if old is None else 0.7 * old + 0.3 * rate
        self._rate_marks = now
        fixed = self.spec.schedule.long_tail.engines
        if fixed is not None:
            k = min(fixed, max(0, len(now) - 1))
        else:
            cut = self.long_tail_cut.threshold()
            recent = list(self.long_tail_cut.recent)
            long_tokens = sum(p for p in recent if p >= cut) or 1.0
            bulk_tokens = sum(p for p in recent if p < cut) or 1.0
            # no measurement yet: one engine's rate for both roles (then k follows the tokens)
            bulk_rate = self.role_rates["bulk"] or self.role_rates["long"] or 1.0
            long_rate = self.role_rates["long"] or bulk_rate
            k = split_engines(len(now), long_tokens, bulk_tokens, long_rate, bulk_rate)
        self.long_tail = set(sorted(now)[:k])
        return k

    def metrics(self) -> dict[str, float]:
        """``dispatch/*`` for the step's report."""
        cut = self.long_tail_cut.threshold()
        return {"dispatch/long_tail_engines": float(len(self.long_tail)),
                "dispatch/long_tail_cut": cut if math.isfinite(cut) else 0.0,
                **{f"dispatch/{role}_tokens_per_s": rate for role, rate in self.role_rates.items() if rate}}
