"""Reward functions: reads for the pages. A team's list takes the team the page shows (one
of the viewer's); a look-up by id goes through visible_reward_functions, so another team's
function is not found."""
from __future__ import annotations

from django.db.models import Max, QuerySet

from fluxrl.accounts.services import visible_teams

from .models import RewardFunction, RewardVersion


def team_reward_functions(team) -> QuerySet[RewardFunction]:
    """The team's reward functions by name, each with its latest version number."""
    return RewardFunction.objects.filter(team=team).annotate(latest=Max("versions__version")).order_by("name")


def visible_reward_functions(user) -> QuerySet[RewardFunction]:
    """The reward functions of the user's teams."""
    return RewardFunction.objects.filter(team__in=visible_teams(user))


def reward_versions(function: RewardFunction) -> QuerySet[RewardVersion]:
    """The function's versions, newest first."""
    return function.versions.order_by("-version")


def reward_version(function: RewardFunction, wanted: str) -> RewardVersion | None:
    """The version numbered ``wanted`` (digits), else the newest; None if there is none."""
    versions = reward_versions(function)
    return versions.filter(version=wanted).first() if wanted.isdigit() else versions.first()
