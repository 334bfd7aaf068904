"""Values every dashboard page needs."""
from __future__ import annotations

import os

from workers.rewards.sandbox_boundary import UNSAFE_ENV, SandboxUnavailable, boundary


def sandbox_warning(request) -> dict:
    """A warning for every page while the operator lets reward code run without the
    operating-system sandbox (FLUXRL_UNSAFE_REWARD_CODE=1, workers/rewards/sandbox.py)."""
    if os.environ.get(UNSAFE_ENV) != "1":
        return {}
    try:
        here = boundary()
    except SandboxUnavailable:  # cannot happen with the opt-in set; stay quiet on a race
        return {}
    if here.kind == "bwrap":
        text = (f"{UNSAFE_ENV}=1 is set: engines on hosts without the OS sandbox run reward code with "
                "interpreter-level guards only. This web host has the sandbox.")
    else:
        text = (f"Reward code runs WITHOUT the operating-system sandbox ({UNSAFE_ENV}=1): any team's reward "
                "function can read what this server can read. Missing: " + "; ".join(here.notes))
    return {"sandbox_warning": text}
