"""Team environments: reads for the pages. A team's list takes the team the page shows
(one of the viewer's); a look-up by id goes through visible_environments, so another
team's environment is not found."""
from __future__ import annotations

from django.db.models import Max, QuerySet

from fluxrl.accounts.services import visible_teams

from .models import EnvironmentVersion, TeamEnvironment


def team_environments(team) -> QuerySet[TeamEnvironment]:
    """The team's environments by name, each with its latest version number."""
    return TeamEnvironment.objects.filter(team=team).annotate(latest=Max("versions__version")).order_by("name")


def visible_environments(user) -> QuerySet[TeamEnvironment]:
    """The environments of the user's teams."""
    return TeamEnvironment.objects.filter(team__in=visible_teams(user))


def environment_versions(environment: TeamEnvironment) -> QuerySet[EnvironmentVersion]:
    """The environment's versions, newest first."""
    return environment.versions.order_by("-version")
