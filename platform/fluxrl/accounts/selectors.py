"""Teams: reads for the pages, each within the teams the user belongs to."""
from __future__ import annotations

from django.db.models import QuerySet

from .models import Team
from .services import visible_teams


def teams_by_slug(user) -> QuerySet[Team]:
    """The user's teams in slug order (the dashboard's team switcher)."""
    return visible_teams(user).order_by("slug")
