"""What every section of the run spec shares: strict models (an unknown field is an error
that names it) and the absolute caps on what one spec may ask."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# Absolute caps on what one spec may ask, whatever the deployment: a completion longer than
# any model's context an RL run generates, and a run (or one evaluation) longer than a month,
# are mistakes, and each multiplies a run's total work (run_work; the platform bounds that).
MAX_TOKENS = 262_144
MAX_RUN_MINUTES = 30 * 24 * 60

# A prompt group's samples run side by side on one engine; past this a "group" is a batch
# of its own (GRPO-style runs use 4 to 64).
MAX_GROUP_SIZE = 1024
