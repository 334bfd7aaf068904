"""Stored models: reads for the pages, within the team the page shows (one of the viewer's)."""
from __future__ import annotations

from .models import StoredModelVersion


def team_models(team) -> list[dict]:
    """Each of the team's model folders by name: its newest version ("version") and how
    many it has ("count")."""
    versions = StoredModelVersion.objects.filter(model__team=team).select_related("model").order_by(
        "model__name", "-version")
    models = {}
    for v in versions:  # newest first within each model
        models.setdefault(v.model_id, {"version": v, "count": 0})["count"] += 1
    return list(models.values())
