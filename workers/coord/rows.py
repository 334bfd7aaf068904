"""The run's data position: training rows, epoch after epoch in a shuffled order.

Saved in checkpoints (checkpointing.py): the current epoch's order, the next index in
it, and rows drawn before a checkpoint but not trained on (redone first)."""
from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator


class RowSource:
    """The training rows (``rows``, set once loaded) and where the run is in them.

    ``rng``: the controller's, shared with dispatch, so a checkpoint's one RNG state
    restores both sequences."""

    def __init__(self, rng: random.Random):
        self.rows: list[dict] = []
        self.rng = rng
        self.order: list[int] = []
        self.pos = 0
        self.redo: deque[dict] = deque()

    def draw(self) -> Iterator[dict]:
        """Training rows, epoch after epoch in a shuffled order; rows a checkpoint saved
        as drawn but not trained on come first."""
        while True:
            if self.redo:
                yield self.redo.popleft()
                continue
            if self.pos >= len(self.order):
                self.order = list(range(len(self.rows)))
                self.rng.shuffle(self.order)
                self.pos = 0
            self.pos += 1
            yield self.rows[self.order[self.pos - 1]]

    def state(self, unfinished: list[dict]) -> dict:
        """The position as plain data; ``unfinished`` (drawn, not trained on) is redone first."""
        return {"order": list(self.order), "pos": self.pos, "redo": list(unfinished) + list(self.redo)}

    def load_state(self, state: dict) -> None:
        self.order, self.pos = list(state["order"]), state["pos"]
        self.redo = deque(state["redo"])
