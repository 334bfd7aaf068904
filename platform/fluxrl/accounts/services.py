"""Teams, membership and bearer tokens (users' API tokens and workers' run tokens)."""
from __future__ import annotations

import copy
import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from fluxrl.errors import Conflict, Forbidden, InvalidInput, NotFound, field_error

from .models import ApiToken, Membership, Role, RunToken, Scope, Team

USER_KEY_PREFIX = "flxu_"
RUN_KEY_PREFIX = "flxr_"
LAST_USED_RESOLUTION = timedelta(minutes=1)  # avoid a write on every request


def hash_key(key: str) -> str:
    # Keys are 256-bit random, so a plain digest is enough (no salt or slow hash needed).
    return hashlib.sha256(key.encode()).hexdigest()


def new_key(kind_prefix: str, key: str | None = None) -> tuple[str, dict]:
    """A fresh random key (or the given one) and the fields stored for it."""
    key = key or kind_prefix + secrets.token_urlsafe(32)
    return key, {"prefix": key[: len(kind_prefix) + 6], "key_hash": hash_key(key)}


# --- teams -----------------------------------------------------------------------


def visible_teams(user, token: ApiToken | None = None) -> QuerySet[Team]:
    """The teams whose objects this request may see: the user's, narrowed by a team-bound token."""
    teams = Team.objects.filter(memberships__user=user)
    if isinstance(token, ApiToken) and token.team_id:
        teams = teams.filter(id=token.team_id)
    return teams


def pick_team(user, token: ApiToken | None, slug: str | None) -> Team:
    """The team a new object goes to: the one named, or the only one the user can see."""
    teams = visible_teams(user, token)
    if slug:
        team = teams.filter(slug=slug).first()
        if team is None:
            raise NotFound(f"No team '{slug}' among your teams.", fields={"team": "not one of your teams"})
        return team
    only = list(teams[:2])
    if len(only) != 1:
        raise field_error("team", "required: name the team (slug) this belongs to")
    return only[0]


def get_visible_team(user, token, slug: str) -> Team:
    team = visible_teams(user, token).filter(slug=slug).first()
    if team is None:
        raise NotFound(f"No team '{slug}' among your teams.")
    return team


def require_admin(user, team: Team) -> None:
    if not Membership.objects.filter(user=user, team=team, role=Role.ADMIN).exists():
        raise Forbidden(f"Only an admin of team '{team.slug}' may do this.")


def may_create_team(user) -> bool:
    """FLUXRL_TEAM_CREATION: "staff" (the default) lets only operators create teams, as each
    team is a tenant with quotas of its own; "anyone" lets every signed-in person."""
    if settings.FLUXRL_TEAM_CREATION == "anyone":
        return bool(getattr(user, "is_authenticated", False))
    return bool(getattr(user, "is_staff", False))


@transaction.atomic
def create_team(user, name: str, slug: str) -> Team:
    if not may_create_team(user):
        raise Forbidden("Only platform staff may create teams on this server (FLUXRL_TEAM_CREATION=staff): ask an "
                        "operator to create one, or a team admin to add you to theirs.")
    if Team.objects.filter(slug=slug).exists():
        raise Conflict(f"A team with slug '{slug}' already exists.", fields={"slug": "already taken"})
    team = Team.objects.create(name=name, slug=slug)
    Membership.objects.create(user=user, team=team, role=Role.ADMIN)
    return team


def add_member(team: Team, by, username: str, role: str = Role.MEMBER) -> Membership:
    require_admin(by, team)
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        raise NotFound(f"No user '{username}'.", fields={"username": "no such user"})
    membership, created = Membership.objects.get_or_create(user=user, team=team, defaults={"role": role})
    if not created:
        raise Conflict(f"'{username}' is already a member of '{team.slug}'.")
    return membership


@transaction.atomic
def remove_member(team: Team, by, username: str) -> None:
    require_admin(by, team)
    membership = Membership.objects.select_for_update().filter(team=team, user__username=username).first()
    if membership is None:
        raise NotFound(f"'{username}' is not a member of '{team.slug}'.")
    if membership.role == Role.ADMIN and not team.memberships.filter(role=Role.ADMIN).exclude(pk=membership.pk).exists():
        raise Conflict("A team must keep at least one admin.")
    membership.delete()
    # the run tokens they minted for the team's runs end with their membership (check_key
    # refuses them anyway; revoked, they stay dead if the member comes back)
    RunToken.objects.filter(minted_by=membership.user_id, run__team=team, revoked_at__isnull=True).update(
        revoked_at=timezone.now())


# --- team default exporters (a run spec's `report` section) ----------------------

EXPORTERS = ("tensorboard", "mlflow", "wandb")  # workers/spec/report.py ReportSpec's sections


def clean_report(report, field: str = "report", team: Team | None = None) -> dict:
    """A `report` section checked by workers.spec (its one validator) and by the platform's
    own rules (exporters write only inside the run's folder, or to an MLflow server the
    operator lists; with ``team``, tracker names inside its namespace); the fields as
    given, exporters switched off (null, false) left out. Errors name the field."""
    from pydantic import ValidationError

    from workers.spec import ReportSpec, report_outside_namespace, report_paths_outside_run

    if not isinstance(report, dict):
        raise field_error(field, "a mapping of exporters: {tensorboard: {...}, mlflow: {...}, wandb: {...}}")
    try:
        checked = ReportSpec.model_validate(report)
    except ValidationError as exc:
        fields = {".".join([field, *map(str, e["loc"])]): "unknown field" if e["type"] == "extra_forbidden"
                  else e["msg"] for e in exc.errors()}
        raise InvalidInput("; ".join(f"{k}: {v}" for k, v in fields.items()), fields=fields) from None
    refused = report_paths_outside_run(checked, settings.FLUXRL_MLFLOW_SERVERS)
    if team is not None:
        refused += report_outside_namespace(checked, **tracker_namespace(team))
    outside = {f"{field}.{e['field'].partition('.')[2]}": e["message"] for e in refused}
    if outside:
        raise InvalidInput("; ".join(f"{k}: {v}" for k, v in outside.items()), fields=outside)
    given = checked.model_dump(mode="json", exclude_unset=True)
    return {name: section for name, section in given.items() if section is not None}


def set_report_defaults(team: Team, by, report) -> Team:
    """A team admin sets the exporters every run of the team gets unless its spec says
    otherwise (merge_report)."""
    require_admin(by, team)
    team.report_defaults = clean_report(report, team=team)
    team.save(update_fields=["report_defaults"])
    return team


def tracker_namespace(team: Team) -> dict[str, str]:
    """The team's namespace on the shared experiment trackers, as the operator sets it
    (FLUXRL_MLFLOW_EXPERIMENT_PREFIX, FLUXRL_WANDB_PROJECT_PREFIX with {team} its slug,
    FLUXRL_WANDB_ENTITY): the arguments of workers.spec's report_outside_namespace and
    namespace_defaults. A name outside it is refused rather than prefixed, so that what a
    spec says is where its run logs, and a spec cloned or resubmitted means the same."""
    return {"mlflow_prefix": settings.FLUXRL_MLFLOW_EXPERIMENT_PREFIX.replace("{team}", team.slug),
            "wandb_prefix": settings.FLUXRL_WANDB_PROJECT_PREFIX.replace("{team}", team.slug),
            "wandb_entity": settings.FLUXRL_WANDB_ENTITY}


def merge_report(defaults: dict, own) -> dict:
    """A run's `report` over its team's defaults, field by field: the run's fields win, a
    run's null or false switches a team exporter off, true takes the team's settings."""
    if not isinstance(own, dict):
        return copy.deepcopy(defaults) if own is None else own  # anything else: the spec's validator says why
    merged = copy.deepcopy(defaults)
    for name, section in own.items():
        team_section = defaults.get(name)
        if isinstance(section, dict) and isinstance(team_section, dict):
            merged[name] = {**team_section, **section}
        elif section is True and isinstance(team_section, dict):
            merged[name] = dict(team_section)
        else:
            merged[name] = section
    return merged


# --- user API tokens -------------------------------------------------------------


def create_api_token(
    user,
    name: str,
    scopes: list[str] | None = None,
    team: Team | None = None,
    expires_at: datetime | None = None,
    via: ApiToken | None = None,
    key: str | None = None,
) -> tuple[ApiToken, str]:
    """Returns the token and its plain key, which is shown this once and never stored.
    A token created through another token can have no more power than that one."""
    scopes = sorted(set(scopes or [Scope.READ, Scope.WRITE]))
    if team is not None and not Membership.objects.filter(user=user, team=team).exists():
        raise NotFound(f"No team '{team.slug}' among your teams.")
    if via is not None:
        if not set(scopes) <= set(via.scopes):
            raise Forbidden("A token cannot create a token with scopes it does not have.")
        if via.team_id and (team is None or team.id != via.team_id):
            raise Forbidden("A team-bound token can only create tokens bound to the same team.")
    key, fields = new_key(USER_KEY_PREFIX, key)
    token = ApiToken.objects.create(user=user, name=name, scopes=scopes, team=team, expires_at=expires_at, **fields)
    return token, key


def revoke_api_token(token: ApiToken) -> None:
    """Revokes the token and the run tokens minted with it."""
    now = timezone.now()
    if token.revoked_at is None:
        token.revoked_at = now
        token.save(update_fields=["revoked_at"])
    RunToken.objects.filter(minted_with=token, revoked_at__isnull=True).update(revoked_at=now)


# --- run tokens (workers) ---------------------------------------------------------


def earliest(*moments: datetime | None) -> datetime | None:
    """The first of the given expiries (None: never)."""
    return min((m for m in moments if m is not None), default=None)


def create_run_token(run, ttl_hours: float | None = None, minted_by=None,
                     minted_with: ApiToken | None = None) -> tuple[RunToken, str]:
    """A key that lets a worker report metrics, samples, status and checkpoints for this
    run only. It stops working when the run reaches a terminal state or after ttl_hours
    (FLUXRL_RUN_TOKEN_TTL_HOURS by default; 0 = no expiry). One a person mints (minted_by,
    minted_with: the API token used, if any) has no more rights than they have: never
    later than that API token's expiry, and refused once they leave the run's team
    (check_key). The dispatcher's (no minter) are the run's own, for its engine."""
    ttl = settings.FLUXRL_RUN_TOKEN_TTL_HOURS if ttl_hours is None else ttl_hours
    expires_at = timezone.now() + timedelta(hours=ttl) if ttl else None
    if isinstance(minted_with, ApiToken):
        expires_at = earliest(expires_at, minted_with.expires_at)
    else:
        minted_with = None  # a session: bound by the user's membership only
    key, fields = new_key(RUN_KEY_PREFIX)
    token = RunToken.objects.create(run=run, expires_at=expires_at, minted_by=minted_by, minted_with=minted_with,
                                    **fields)
    return token, key


def renew_run_token(token: RunToken) -> None:
    """A live run's heartbeat keeps its token valid for another FLUXRL_RUN_TOKEN_TTL_HOURS:
    the TTL bounds how long a token outlives the engine that held it, not how long a run
    may train (a two-week run would otherwise lose its reports on day 7). Never past the
    expiry of the API token that minted it."""
    ttl = settings.FLUXRL_RUN_TOKEN_TTL_HOURS
    if not ttl or token.expires_at is None:
        return
    expires_at = earliest(timezone.now() + timedelta(hours=ttl),
                          token.minted_with.expires_at if token.minted_with_id else None)
    # at most one write per minute of heartbeats
    if expires_at - token.expires_at > timedelta(minutes=1):
        RunToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(expires_at=expires_at)


def revoke_run_tokens(run) -> None:
    RunToken.objects.filter(run=run, revoked_at__isnull=True).update(revoked_at=timezone.now())


# --- authentication ---------------------------------------------------------------


@dataclass(frozen=True)
class RunPrincipal:
    """request.user for a run token: authenticated, but no person and no team rights."""

    run_id: int
    is_authenticated = True
    is_anonymous = False
    is_active = True
    is_staff = False
    is_superuser = False

    def __str__(self):
        return f"run-{self.run_id}"


class KeyRefused(Exception):
    """A key that is not (or no longer) accepted; the message says why."""


def authenticate_key(key: str):
    """(principal, token) for a valid key, None for an unknown, expired or revoked one."""
    try:
        return check_key(key)
    except KeyRefused:
        return None


def check_minter(token: RunToken) -> None:
    """A run token a person minted works only while they still could mint it: an active
    member of the run's team, with the API token they used still live."""
    if token.minted_with_id and not token.minted_with.is_active:
        why = "been revoked" if token.minted_with.revoked_at else "expired"
        raise KeyRefused(f"The API token that minted this run token has {why}: the run token ended with it.")
    user = token.minted_by
    if token.minted_by_id and not (user.is_active and Membership.objects.filter(user=user, team=token.run.team_id).exists()):
        raise KeyRefused("This run token's minter is no longer an active member of the run's team: it is revoked.")


def check_key(key: str):
    """(principal, token) for a valid key; raises KeyRefused saying why it is not. A run
    token works only while its run is live: from the moment the run ends it is refused,
    whether or not its revocation (runs.services.transition) has been written yet."""
    model = RunToken if key.startswith(RUN_KEY_PREFIX) else ApiToken
    related = ["run", "minted_by", "minted_with"] if model is RunToken else ["user"]
    token = model.objects.select_related(*related).filter(key_hash=hash_key(key)).first()
    if token is None:
        raise KeyRefused("Invalid, expired or revoked token.")
    if isinstance(token, RunToken) and token.run.is_terminal:
        raise KeyRefused(f"Run {token.run_id} has {token.run.status}: its run token takes no more reports.")
    if isinstance(token, RunToken):
        check_minter(token)  # first: when it was revoked for its minter, say so
    if not token.is_active:
        raise KeyRefused("This token has been revoked." if token.revoked_at else "This token has expired.")
    if isinstance(token, RunToken):
        return RunPrincipal(token.run_id), token
    if not token.user.is_active:
        raise KeyRefused("This token's user is inactive.")
    now = timezone.now()
    if token.last_used_at is None or now - token.last_used_at > LAST_USED_RESOLUTION:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return token.user, token
