"""Datasets: reads for the pages. A team's list takes the team the page shows (one of the
viewer's); a look-up by id goes through visible_datasets, so another team's dataset is
not found."""
from __future__ import annotations

from django.db.models import Count, Max, QuerySet

from fluxrl.accounts.services import visible_teams

from .models import Dataset, DatasetVersion


def team_datasets(team) -> QuerySet[Dataset]:
    """The team's datasets by name, each with version_count and its latest version number."""
    return Dataset.objects.filter(team=team).annotate(
        version_count=Count("versions"), latest=Max("versions__version")).order_by("name")


def visible_datasets(user) -> QuerySet[Dataset]:
    """The datasets of the user's teams."""
    return Dataset.objects.filter(team__in=visible_teams(user))


def dataset_versions(dataset: Dataset) -> list[DatasetVersion]:
    """The dataset's versions, newest first, with who made each."""
    return list(dataset.versions.select_related("created_by").order_by("-version"))
