"""Runs: reads for the pages. A look-up by id goes through visible_runs, so another team's
run is not found; a team's lists take the team the page shows (one of the viewer's); a
run's samples and tags take a run found that way."""
from __future__ import annotations

from django.db.models import QuerySet

from fluxrl.accounts.services import visible_teams

from .models import Run, Sample


def visible_runs(user) -> QuerySet[Run]:
    """The runs of the user's teams, with their team, owner, dataset, reward and environment versions."""
    return Run.objects.filter(team__in=visible_teams(user)).select_related(
        "team", "owner", "dataset_version", "reward_version", "environment_version__environment")


def team_has_runs(team) -> bool:
    return team.runs.exists()


def team_runs_by_id(team, ids) -> dict[int, Run]:
    """The team's runs among ``ids``, by id (ids of other teams' runs are left out)."""
    runs = Run.objects.filter(team=team, pk__in=ids).select_related("owner", "dataset_version", "reward_version")
    return {run.pk: run for run in runs}


def recent_runs(team, limit: int) -> QuerySet[Run]:
    """The team's ``limit`` newest runs."""
    return Run.objects.filter(team=team).order_by("-created_at")[:limit]


def recent_samples(run: Run, limit: int) -> QuerySet[Sample]:
    """The run's ``limit`` newest samples."""
    return run.samples.order_by("-step", "-id")[:limit]


def sample_count(run: Run) -> int:
    return run.samples.count()


def tag_names(run: Run) -> list[str]:
    return list(run.tags.values_list("name", flat=True))
