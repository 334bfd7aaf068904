"""Per-team quotas and per-run ceilings.

A team's limits are its TeamQuota's fields where an admin set them, else the deployment's
defaults (FLUXRL_QUOTA_*). Runs count while they are live: queued, starting or running. A
queued run counts because it has claimed its resources already: it starts without another
check, so a team that could queue without limit could fill every worker's queue.

Every check locks the team's row (SELECT ... FOR NO KEY UPDATE, which does not block rows
that merely reference the team) inside the caller's transaction, before it counts, and the
caller creates the run or version in that same transaction: two requests racing for the
last slot are serialized, and the second one counts the first one's row.

Refusals: over a team quota, 403 (code quota_exceeded: not a rate limit to retry at once;
it lasts until runs end or an admin raises the quota); over the storage quota, 413; a spec
above a per-run ceiling, 400 naming the field, as any other invalid spec."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from django.apps import apps
from django.conf import settings
from django.db import transaction
from django.db.models import Count, Func, IntegerField, Sum

from fluxrl.accounts.models import Team
from fluxrl.errors import Forbidden, TooLarge, field_error

from .models import TeamQuota

log = logging.getLogger(__name__)

LIVE_STATUSES = ("queued", "starting", "running")  # runs.models.RunStatus's live ones (not imported: no cycle)


class QuotaExceeded(Forbidden):
    code = "quota_exceeded"


class StorageQuotaExceeded(TooLarge):
    code = "quota_exceeded"


@dataclass(frozen=True)
class Kind:
    field: str  # TeamQuota's
    setting: str  # the deployment default's, in settings
    label: str
    env: str = ""  # the environment variable that sets it, when not named like the setting

    @property
    def env_name(self) -> str:
        return self.env or self.setting


KINDS = {
    "runs": Kind("max_runs", "FLUXRL_QUOTA_RUNS", "concurrent runs"),
    "engines": Kind("max_engines", "FLUXRL_QUOTA_ENGINES", "rollout engines"),
    "nodes": Kind("max_nodes", "FLUXRL_QUOTA_NODES", "nodes"),
    "storage_bytes": Kind("max_storage_bytes", "FLUXRL_QUOTA_STORAGE_BYTES", "stored bytes", "FLUXRL_QUOTA_STORAGE_MB"),
    "files": Kind("max_files", "FLUXRL_QUOTA_FILES", "stored files"),
}
# spec field -> (its name in errors, the ceiling's setting)
CEILINGS = {
    ("rollout", "engines"): ("spec.rollout.engines", "FLUXRL_MAX_ENGINES_PER_RUN"),
    ("resources", "nodes"): ("spec.resources.nodes", "FLUXRL_MAX_NODES_PER_RUN"),
}


@dataclass(frozen=True)
class Limit:
    value: int | None  # None: no limit
    source: str  # where it comes from, for messages and the API

    def allows(self, total: int) -> bool:
        return self.value is None or total <= self.value


def deployment_default(kind: str) -> int | None:
    value = getattr(settings, KINDS[kind].setting)
    return None if value is None or value < 0 else int(value)


def limits(team: Team) -> dict[str, Limit]:
    quota = TeamQuota.objects.filter(team_id=team.pk).first()
    out = {}
    for name, kind in KINDS.items():
        own = getattr(quota, kind.field, None) if quota is not None else None
        out[name] = (Limit(own, f"the team's quota, {kind.field}, set by an admin") if own is not None
                     else Limit(deployment_default(name), f"{kind.env_name}, the deployment default"))
    return out


def lock_team(team: Team) -> None:
    """Serialize quota checks of one team until the caller's transaction ends."""
    if transaction.get_autocommit():
        raise RuntimeError("quota checks must run inside the transaction that stores what they allow")
    Team.objects.select_for_update(no_key=True).filter(pk=team.pk).exists()


# --- runs ------------------------------------------------------------------------------


def _spec_int(spec: dict, section: str, key: str) -> int:
    value = (spec.get(section) or {}).get(key)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 1


def run_usage(team: Team) -> dict[str, int]:
    """What the team's live runs hold: runs, engines, nodes (from their engine-ready specs)."""
    Run = apps.get_model("runs", "Run")  # by name: quotas sits below the apps that call it

    rows = list(Run.objects.filter(team_id=team.pk, status__in=LIVE_STATUSES)
                .values_list("resolved_spec", flat=True))
    return {"runs": len(rows),
            "engines": sum(_spec_int(spec or {}, "rollout", "engines") for spec in rows),
            "nodes": sum(_spec_int(spec or {}, "resources", "nodes") for spec in rows)}


def check_run_quota(team: Team, spec: dict) -> None:
    """Raise QuotaExceeded (403) if one more live run with this engine-ready spec would take
    the team past its concurrent runs, engines or nodes. Call it inside the transaction
    that makes the run live (submission, resume)."""
    lock_team(team)
    used, limit = run_usage(team), limits(team)
    asks = {"runs": 1, "engines": _spec_int(spec, "rollout", "engines"), "nodes": _spec_int(spec, "resources", "nodes")}
    fields = {"runs": "team", "engines": "spec.rollout.engines", "nodes": "spec.resources.nodes"}
    for name, ask in asks.items():
        if not limit[name].allows(used[name] + ask):
            label, value = KINDS[name].label, limit[name].value
            if name == "runs":
                message = (f"team quota: {used[name]} of {value} {label} in use (live: queued, starting or "
                           f"running), limit from {limit[name].source}; wait for one to end or cancel one")
            else:
                message = (f"team quota: {used[name]} of {value} {label} in use by the team's live runs and this run "
                           f"asks for {ask} (limit from {limit[name].source})")
            log.info("team %s refused a run: %s", team.pk, message)
            raise QuotaExceeded(message, fields={fields[name]: message})


def check_spec_ceilings(spec: dict) -> None:
    """A validated spec asking for more than the deployment allows one run: a 400 naming the field."""
    for (section, key), (field, setting) in CEILINGS.items():
        ceiling = getattr(settings, setting)
        asked = _spec_int(spec, section, key)
        if ceiling is not None and ceiling >= 0 and asked > ceiling:
            raise field_error(field, f"{asked} is above this deployment's limit of {ceiling} per run ({setting})")


# --- storage ---------------------------------------------------------------------------


class JSONArrayLength(Func):
    output_field = IntegerField()
    function = "JSON_ARRAY_LENGTH"  # SQLite

    def as_postgresql(self, compiler, connection, **extra):
        return super().as_sql(compiler, connection, function="JSONB_ARRAY_LENGTH", **extra)


def storage_usage(team: Team) -> dict[str, int]:
    """Bytes and files the team stores: its dataset versions (one file each) and uploaded
    model versions (their files)."""
    # by name: the datasets and modelstore services call this module, which sits below them
    DatasetVersion = apps.get_model("datasets", "DatasetVersion")
    StoredModelVersion = apps.get_model("modelstore", "StoredModelVersion")

    datasets = DatasetVersion.objects.filter(dataset__team_id=team.pk).aggregate(
        bytes=Sum("size_bytes"), files=Count("id"))
    models = StoredModelVersion.objects.filter(model__team_id=team.pk).aggregate(
        bytes=Sum("size_bytes"), files=Sum(JSONArrayLength("files")))
    return {"storage_bytes": (datasets["bytes"] or 0) + (models["bytes"] or 0),
            "files": (datasets["files"] or 0) + (models["files"] or 0)}


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def check_storage(team: Team, adding_bytes: int, adding_files: int) -> None:
    """Raise StorageQuotaExceeded (413) if storing this much more would take the team past
    its stored bytes or files. Call it inside the transaction that records what is stored,
    before the files are moved into place."""
    lock_team(team)
    used, limit = storage_usage(team), limits(team)
    for name, adding, unit in (("storage_bytes", adding_bytes, "bytes"), ("files", adding_files, "files")):
        if not limit[name].allows(used[name] + adding):
            value = limit[name].value
            sizes = f" ({_mb(used[name])} of {_mb(value)}, adding {_mb(adding)})" if unit == "bytes" else ""
            message = (f"team quota: {used[name]} of {value} {unit} stored and this upload adds {adding}{sizes}; "
                       f"limit from {limit[name].source}")
            log.info("team %s refused an upload: %s", team.pk, message)
            raise StorageQuotaExceeded(message, fields={"file": message})


def usage_report(team: Team) -> dict:
    """For the API: each quota's use and limit (null: none), and the per-run ceilings."""
    used, limit = {**run_usage(team), **storage_usage(team)}, limits(team)
    report = {name: {"used": used[name], "limit": limit[name].value, "source": limit[name].source} for name in KINDS}
    report["per_run"] = {field.rsplit(".", 1)[1]: getattr(settings, setting) for field, setting in CEILINGS.values()}
    return report
