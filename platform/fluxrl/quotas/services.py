"""Quotas per team, per person and per organisation, and per-run ceilings.

Three holders of limits, each checked on its own:
- the team: live runs, engines and nodes, stored bytes and files (TeamQuota, else
  FLUXRL_QUOTA_*);
- the person: the live runs they submitted and the bytes and files they uploaded, in all
  their teams together (UserQuota, else FLUXRL_QUOTA_USER_*, whose defaults are the team
  ones): a team of one's own brings no new room;
- the organisation a team belongs to, if any: the same over all its teams
  (OrganisationQuota, else FLUXRL_QUOTA_ORG_*, no limit by default).
A field an admin set wins over the deployment default. Runs count while they are live:
queued, starting or running. A queued run counts because it has claimed its resources
already: it starts without another check, so a team that could queue without limit could
fill every worker's queue.

Every check locks the rows it counts for (SELECT ... FOR NO KEY UPDATE, which does not
block rows that merely reference them), always in one order: the team, its organisation,
the person. It does so inside the caller's transaction, before it counts, and the caller
creates the run or version in that same transaction: two requests racing for the last slot
of any of the three are serialized, and the second one counts the first one's row.

Refusals: over a quota of runs, engines or nodes, 403 (code quota_exceeded: not a rate
limit to retry at once; it lasts until runs end or an admin raises the quota); over a
storage quota, 413; each names whose limit it is (person, team, organisation) and who can
raise it. A spec above a per-run ceiling is a 400 naming the field, as any other invalid spec.

The tenant a run is on a shared engine pool (pool_tenant) is also decided here: its weight
must not grow with the number of teams a person or organisation has."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from django.apps import apps
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import Count, Func, IntegerField, Sum

from fluxrl.accounts.models import Organisation, Team
from fluxrl.errors import Forbidden, TooLarge, field_error

from .models import OrganisationQuota, TeamQuota, UserQuota

if TYPE_CHECKING:
    from workers.spec import RunSpec

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
# a run's total work in tokens (workers.spec.run_work): its name in the quota report -> the ceiling's setting
WORK_CEILINGS = {
    "train_tokens": "FLUXRL_MAX_TRAIN_TOKENS_PER_RUN",
    "eval_set_tokens": "FLUXRL_MAX_EVAL_SET_TOKENS",
    "eval_tokens": "FLUXRL_MAX_EVAL_TOKENS_PER_RUN",
}


@dataclass(frozen=True)
class Limit:
    value: int | None  # None: no limit
    source: str  # where it comes from, for messages and the API

    def allows(self, total: int) -> bool:
        return self.value is None or total <= self.value


@dataclass(frozen=True)
class Holder:
    """Whose limits: a team, a person (across their teams) or an organisation (across its teams)."""

    scope: str  # "team", "person" or "organisation": how messages name it
    quota: type  # its model of limits an admin sets
    owner_field: str  # that model's field naming the holder
    prefix: str  # its deployment defaults: FLUXRL_QUOTA_<prefix>RUNS, ...
    kinds: tuple[str, ...]  # the KINDS it has limits of
    error_field: str  # the error's field for a refused run

    def setting(self, kind: str) -> str:
        return KINDS[kind].setting.replace("FLUXRL_QUOTA_", f"FLUXRL_QUOTA_{self.prefix}", 1)

    def env_name(self, kind: str) -> str:
        return KINDS[kind].env_name.replace("FLUXRL_QUOTA_", f"FLUXRL_QUOTA_{self.prefix}", 1)

    def raised_by(self, kind: str) -> str:
        return (f"a platform admin can raise it: the {self.scope}'s {self.quota.__name__} in the Django admin, "
                f"or {self.env_name(kind)} for all")


SHARED_KINDS = ("runs", "storage_bytes", "files")  # what a person's and an organisation's limits cover
TEAM = Holder("team", TeamQuota, "team", "", tuple(KINDS), "team")
PERSON = Holder("person", UserQuota, "user", "USER_", SHARED_KINDS, "owner")
ORGANISATION = Holder("organisation", OrganisationQuota, "organisation", "ORG_", SHARED_KINDS, "organisation")


def deployment_default(kind: str, holder: Holder = TEAM) -> int | None:
    value = getattr(settings, holder.setting(kind))
    return None if value is None or value < 0 else int(value)


def holder_limits(holder: Holder, owner_id: int) -> dict[str, Limit]:
    quota = holder.quota.objects.filter(**{f"{holder.owner_field}_id": owner_id}).first()
    out = {}
    for name in holder.kinds:
        field = KINDS[name].field
        own = getattr(quota, field, None) if quota is not None else None
        out[name] = (Limit(own, f"the {holder.scope}'s quota, {field}, set by an admin") if own is not None
                     else Limit(deployment_default(name, holder), f"{holder.env_name(name)}, the deployment default"))
    return out


def limits(team: Team) -> dict[str, Limit]:
    return holder_limits(TEAM, team.pk)


def _lock(model, pk) -> None:
    model.objects.select_for_update(no_key=True).filter(pk=pk).exists()


def lock_team(team: Team) -> None:
    """Serialize quota checks of one team until the caller's transaction ends."""
    if transaction.get_autocommit():
        raise RuntimeError("quota checks must run inside the transaction that stores what they allow")
    _lock(Team, team.pk)


def lock_holders(team: Team, user=None) -> list[tuple[Holder, int, str]]:
    """Lock the team's row, its organisation's and the person's, in that order (always the
    same: two checks never wait for each other in a cycle), and return who holds limits
    here: (holder, its id, its name for messages). The organisation is read under the
    team's lock: an admin moving the team waits for this transaction."""
    lock_team(team)
    holders = [(TEAM, team.pk, f"team '{team.slug}'")]
    org = Organisation.objects.filter(teams=team.pk).values_list("pk", "slug").first()
    if org is not None:
        _lock(Organisation, org[0])
        holders.append((ORGANISATION, org[0], f"organisation '{org[1]}'"))
    user_id = getattr(user, "pk", None) if getattr(user, "is_authenticated", False) else None
    if isinstance(user_id, int):
        _lock(get_user_model(), user_id)
        holders.append((PERSON, user_id, f"user '{user.get_username()}' (their runs and uploads in all their teams)"))
    return holders


def refusal(holder: Holder, who: str, kind: str, used: int, limit: Limit, what: str) -> str:
    """A refusal's message: whose limit, the numbers, where the limit comes from, who can raise it."""
    return (f"{holder.scope} quota of {who}: {used} of {limit.value} {what}; limit from {limit.source}; "
            f"{holder.raised_by(kind)}")


# --- runs ------------------------------------------------------------------------------


def _spec_int(spec: dict, section: str, key: str) -> int:
    value = (spec.get(section) or {}).get(key)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 1


def _live_runs(holder: Holder, owner_id: int):
    Run = apps.get_model("runs", "Run")  # by name: quotas sits below the apps that call it
    where = {TEAM: {"team_id": owner_id}, PERSON: {"owner_id": owner_id},
             ORGANISATION: {"team__organisation_id": owner_id}}[holder]
    return Run.objects.filter(status__in=LIVE_STATUSES, **where)


def holder_run_usage(holder: Holder, owner_id: int) -> dict[str, int]:
    """What the holder's live runs hold: runs, engines, nodes (from their engine-ready specs)."""
    rows = list(_live_runs(holder, owner_id).values_list("resolved_spec", flat=True))
    return {"runs": len(rows),
            "engines": sum(_spec_int(spec or {}, "rollout", "engines") for spec in rows),
            "nodes": sum(_spec_int(spec or {}, "resources", "nodes") for spec in rows)}


def run_usage(team: Team) -> dict[str, int]:
    return holder_run_usage(TEAM, team.pk)


def check_run_quota(team: Team, spec: dict, owner=None) -> None:
    """Raise QuotaExceeded (403) if one more live run with this engine-ready spec, submitted
    by owner, would take the team past its concurrent runs, engines or nodes, the owner
    past their runs in all their teams, or the team's organisation past its runs. Call it
    inside the transaction that makes the run live (submission, resume)."""
    asks = {"runs": 1, "engines": _spec_int(spec, "rollout", "engines"), "nodes": _spec_int(spec, "resources", "nodes")}
    for holder, owner_id, who in lock_holders(team, owner):
        used, limit = holder_run_usage(holder, owner_id), holder_limits(holder, owner_id)
        fields = {"runs": holder.error_field, "engines": "spec.rollout.engines", "nodes": "spec.resources.nodes"}
        for name in holder.kinds:
            if name not in asks or limit[name].allows(used[name] + asks[name]):
                continue
            label = KINDS[name].label
            if name == "runs":
                message = refusal(holder, who, name, used[name], limit[name],
                                  f"{label} in use (live: queued, starting or running)")
                message += "; or wait for one to end or cancel one"
            else:
                message = refusal(holder, who, name, used[name], limit[name],
                                  f"{label} in use by live runs and this run asks for {asks[name]}")
            log.info("%s %s refused a run: %s", holder.scope, owner_id, message)
            raise QuotaExceeded(message, fields={fields[name]: message})


def check_spec_ceilings(run: RunSpec) -> None:
    """A validated spec asking for more than the deployment allows one run: a 400 naming the field."""
    spec = run.to_dict()
    for (section, key), (field, setting) in CEILINGS.items():
        ceiling = getattr(settings, setting)
        asked = _spec_int(spec, section, key)
        if ceiling is not None and ceiling >= 0 and asked > ceiling:
            raise field_error(field, f"{asked} is above this deployment's limit of {ceiling} per run ({setting})")
    check_work_ceilings(run)


def check_work_ceilings(run: RunSpec) -> None:
    """A validated spec whose total work (the most tokens it can generate: workers.spec.run_work)
    is above a WORK_CEILINGS setting: a 400 naming the field, the amount and the limit."""
    from workers.spec import run_work

    work, tokens = run_work(run), run.rollout.max_tokens

    def over(name: str, amount: int) -> int | None:
        ceiling = getattr(settings, WORK_CEILINGS[name])
        return ceiling if ceiling is not None and ceiling >= 0 and amount > ceiling else None

    def limit(name: str, ceiling: int, per: str) -> str:
        return f"above this deployment's limit of {ceiling:,} {per} ({WORK_CEILINGS[name]})"

    ceiling = over("train_tokens", work.training)
    if ceiling is not None:
        raise field_error("spec.stop.max_steps", (
            f"{run.stop.max_steps} steps x {run.schedule.batch_prompts} prompts x {run.algorithm.group_size} samples "
            f"x {tokens} max_tokens = {work.training:,} tokens generated in training at most, "
            f"{limit('train_tokens', ceiling, 'per run')}; lower stop.max_steps, schedule.batch_prompts, "
            "algorithm.group_size or rollout.max_tokens"))
    for i, (one, amount) in enumerate(zip(run.eval.sets, work.sets)):
        ceiling = over("eval_set_tokens", amount)
        if ceiling is not None:
            raise field_error(f"spec.eval.sets.{i}", (
                f"{amount // (one.n * tokens)} prompts x {one.n} samples x {tokens} max_tokens = {amount:,} tokens at "
                f"each evaluation, {limit('eval_set_tokens', ceiling, 'per evaluation set')}; lower its prompts or n"))
    ceiling = over("eval_tokens", work.evaluation_total)
    if ceiling is not None:
        raise field_error("spec.eval", (
            f"{work.per_evaluation:,} tokens per evaluation x {work.evaluations} evaluations = "
            f"{work.evaluation_total:,} tokens, {limit('eval_tokens', ceiling, 'per run')}; lower eval.prompts, "
            "eval.samples or the sets' prompts or n, or evaluate less often (eval.every_steps)"))


# --- storage ---------------------------------------------------------------------------


class JSONArrayLength(Func):
    output_field = IntegerField()
    function = "JSON_ARRAY_LENGTH"  # SQLite

    def as_postgresql(self, compiler, connection, **extra):
        return super().as_sql(compiler, connection, function="JSONB_ARRAY_LENGTH", **extra)


def holder_storage_usage(holder: Holder, owner_id: int) -> dict[str, int]:
    """Bytes and files the holder stores: dataset versions (one file each) and uploaded
    model versions (their files); a person's are those they uploaded, in any team."""
    # by name: the datasets and modelstore services call this module, which sits below them
    DatasetVersion = apps.get_model("datasets", "DatasetVersion")
    StoredModelVersion = apps.get_model("modelstore", "StoredModelVersion")

    dataset_where = {TEAM: {"dataset__team_id": owner_id}, PERSON: {"created_by_id": owner_id},
                     ORGANISATION: {"dataset__team__organisation_id": owner_id}}[holder]
    model_where = {TEAM: {"model__team_id": owner_id}, PERSON: {"created_by_id": owner_id},
                   ORGANISATION: {"model__team__organisation_id": owner_id}}[holder]
    datasets = DatasetVersion.objects.filter(**dataset_where).aggregate(bytes=Sum("size_bytes"), files=Count("id"))
    models = StoredModelVersion.objects.filter(**model_where).aggregate(
        bytes=Sum("size_bytes"), files=Sum(JSONArrayLength("files")))
    return {"storage_bytes": (datasets["bytes"] or 0) + (models["bytes"] or 0),
            "files": (datasets["files"] or 0) + (models["files"] or 0)}


def storage_usage(team: Team) -> dict[str, int]:
    return holder_storage_usage(TEAM, team.pk)


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def check_storage(team: Team, adding_bytes: int, adding_files: int, user=None) -> None:
    """Raise StorageQuotaExceeded (413) if storing this much more, uploaded by user, would
    take the team, the user (across their teams) or the team's organisation past its stored
    bytes or files. Call it inside the transaction that records what is stored, before the
    files are moved into place."""
    for holder, owner_id, who in lock_holders(team, user):
        used, limit = holder_storage_usage(holder, owner_id), holder_limits(holder, owner_id)
        for name, adding, unit in (("storage_bytes", adding_bytes, "bytes"), ("files", adding_files, "files")):
            if not limit[name].allows(used[name] + adding):
                value = limit[name].value
                sizes = f" ({_mb(used[name])} of {_mb(value)}, adding {_mb(adding)})" if unit == "bytes" else ""
                message = refusal(holder, who, name, used[name], limit[name],
                                  f"{unit} stored and this upload adds {adding}{sizes}")
                log.info("%s %s refused an upload: %s", holder.scope, owner_id, message)
                raise StorageQuotaExceeded(message, fields={"file": message})


def holder_report(holder: Holder, owner_id: int) -> dict:
    used = {**holder_run_usage(holder, owner_id), **holder_storage_usage(holder, owner_id)}
    limit = holder_limits(holder, owner_id)
    return {name: {"used": used[name], "limit": limit[name].value, "source": limit[name].source}
            for name in holder.kinds}


def usage_report(team: Team, user=None) -> dict:
    """For the API: each of the team's quotas' use and limit (null: none), the per-run
    ceilings, and the same for the person asking (across their teams) and the team's
    organisation (null when it has none)."""
    report = holder_report(TEAM, team.pk)
    report["per_run"] = {field.rsplit(".", 1)[1]: getattr(settings, setting) for field, setting in CEILINGS.values()}
    report["per_run"].update({name: getattr(settings, setting) for name, setting in WORK_CEILINGS.items()})
    user_id = getattr(user, "pk", None) if getattr(user, "is_authenticated", False) else None
    report["person"] = holder_report(PERSON, user_id) if isinstance(user_id, int) else None
    org = Organisation.objects.filter(teams=team.pk).first()
    report["organisation"] = ({"slug": org.slug, **holder_report(ORGANISATION, org.pk)}
                              if org is not None else None)
    return report


# --- shared engine pools ---------------------------------------------------------------


def pool_tenant(run) -> tuple[str, float]:
    """rollout.share_engines (workers/rollout/pool.py): the tenant a run is on a shared
    engine pool, and its weight in the pool's fair share. An organisation's teams are one
    tenant ("org-<id>") with the organisation's engine_share, so more teams in it add no
    weight; a team without one is its own tenant ("team-<id>") with the team's engine_share.
    Both weights are the operator's (Django admin), never a spec's or a team admin's; a
    person can multiply team tenants only where FLUXRL_TEAM_CREATION lets anyone create
    teams (staff only by default)."""
    team = Team.objects.select_related("organisation").get(pk=run.team_id)
    if team.organisation is not None:
        return f"org-{team.organisation_id}", float(team.organisation.engine_share)
    return f"team-{team.pk}", float(team.engine_share)
