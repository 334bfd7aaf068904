"""Scoring try-it rows in a sandbox child of this process (workers.rewards.sandbox): in the
sandbox service's task (tasks.try_reward) and, in the embedded default, in the web process
itself (services.score_here). No Django here: the sandbox service has no database."""
from __future__ import annotations

import os
import socket

from workers.rewards.sandbox import try_reward


def score_here(code: str, rows: list[dict], timeout_s: float, memory_mb: int, score=try_reward) -> dict:
    """Score in a sandbox child of this process. scored_by: which process did (the API
    response leaves it out). score: the sandbox's entry point (services passes its own
    name for it, which tests replace)."""
    outcome = score(code, rows, timeout_s=timeout_s, memory_mb=memory_mb)
    outcome["scored_by"] = {"host": socket.gethostname(), "pid": os.getpid()}
    return outcome
