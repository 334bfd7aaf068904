"""Bounded staleness (AReaL) and per-token policy-version bookkeeping (PipelineRL)."""
from __future__ import annotations

from dataclasses import dataclass, field


class StalenessGate:
    """Admission control for rollouts, counted in rollout units (prompt groups).

    A trainer step consumes ``batch_size`` units and then bumps ``version``. A new unit
    may start only while ``started + running < (max_staleness + version + 1) * batch_size``
    where ``started`` counts units already finished (accepted or rejected). So the data
    of any step was started at most ``max_staleness`` versions before the policy that
    trains on it. ``max_staleness = 0`` with one step in flight is the synchronous case.
    """

    def __init__(self, batch_size: int, max_staleness: int):
        if batch_size < 1 or max_staleness < 0:
            raise ValueError("batch_size must be ≥ 1 and max_staleness ≥ 0")
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.version = 0
        self.finished = 0  # units that finished generating (accepted + rejected)
        self.running = 0

    @property
    def capacity(self) -> int:
        return (self.max_staleness + self.version + 1) * self.batch_size

    def can_start(self) -> bool:
        return self.finished + self.running < self.capacity

    def start(self) -> int:
        """Admit one unit; returns the policy version it starts under."""
        if not self.can_start():
            raise RuntimeError("staleness bound: no rollout may start now")
        self.running += 1
        return self.version

    def finish(self, accepted: bool = True) -> None:
        # A rejected unit (e.g. all-equal rewards filtered out) frees its slot for another.
        self.running -= 1
        if accepted:
            self.finished += 1

    def release(self, n: int = 1) -> None:
        """Give back the slots of finished units that will never be trained on (dropped
        as too stale), so the generation lead is not lost."""
        self.finished -= n

    def advance(self, version: int | None = None) -> None:
        self.version = self.version + 1 if version is None else version


@dataclass
class VersionTrack:
    """Run-length record of which policy version produced each generated token.

    ``runs`` is [[version, count], ...] in token order; a sequence spanning an in-flight
    weight update has more than one run.
    """

    runs: list[list[int]] = field(default_factory=list)

    def add(self, version: int, count: int) -> None:
        if count <= 0:
            return
        if self.runs and self.runs[-1][0] == version:
            self.runs[-1][1] += count
        else:
            self.runs.append([version, count])

    def per_token(self) -> list[int]:
        return [v for v, n in self.runs for _ in range(n)]

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.runs)

    @property
    def oldest(self) -> int:
        return min((v for v, _ in self.runs), default=0)

    @property
    def newest(self) -> int:
        return max((v for v, _ in self.runs), default=0)

    def staleness(self, trainer_version: int) -> int:
        """How many versions behind the trainer the oldest token of this sequence is."""
        return trainer_version - self.oldest
