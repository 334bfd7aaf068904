"""What every section of the run spec shares: strict models (an unknown field is an error
that names it) and the absolute caps on what one spec may ask."""
from __future__ import annotations

from typing import Any, Optional

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

# The schema version of the run spec. A spec states the version it was written for (RunSpec's
# ``version``, this one when left out); an engine refuses a resolved spec of any other version,
# with the reason, rather than read it under rules it was not written for (resolved.py).
SPEC_VERSION = 1


def version_refusal(version: Any) -> Optional[str]:
    """Why a spec written for schema ``version`` cannot run under this FluxRL, or None when it can."""
    if type(version) is int and version == SPEC_VERSION:
        return None
    if version is None:
        return (f"the spec names no schema version; this FluxRL reads version {SPEC_VERSION} only: submit the run "
                "again, so that it is validated under this version")
    if type(version) is int and version > SPEC_VERSION:
        return (f"the spec was written for schema version {version}, newer than the {SPEC_VERSION} this FluxRL "
                "reads: upgrade FluxRL (the platform and the workers)")
    return (f"the spec was written for schema version {version!r}; this FluxRL reads version {SPEC_VERSION} only: "
            "submit it again under this version")


class SpecError(ValueError):
    """A run spec that cannot run. ``errors`` is a list of {"field": "a.b", "message": ...}."""

    def __init__(self, errors: list[dict[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{e['field']}: {e['message']}" for e in errors))
