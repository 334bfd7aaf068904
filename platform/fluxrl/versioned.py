"""Named, versioned team objects (datasets, reward functions): their abstract models,
names, references `name@version` and version numbering."""
from __future__ import annotations

import re

from django.conf import settings
from django.db import models
from django.db.models import Max

from fluxrl.errors import NotFound, field_error

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def check_name(name: str, field: str = "name") -> str:
    # Names appear in references (name@3) and in URLs: no '@', '/', spaces or leading dot.
    if not NAME_PATTERN.fullmatch(name or ""):
        raise field_error(field, "use letters, digits, '.', '_' or '-' (at most 100), starting with a letter or digit")
    return name


def parse_ref(ref: str, field: str) -> tuple[str, int | None]:
    """'name@3' -> ('name', 3); 'name' or 'name@latest' -> ('name', None): the newest version."""
    name, _, version = str(ref).partition("@")
    if version not in ("", "latest") and not version.isdigit():
        raise field_error(field, f"'{ref}' is not name@version (version is a number or 'latest')")
    check_name(name, field)
    return name, int(version) if version.isdigit() else None


def find_version(versions, parent: str, team, ref: str, field: str):
    """The version named by ref among `versions` (a queryset of DatasetVersion or
    RewardVersion, whose FK to the named object is `parent`) of this team."""
    name, number = parse_ref(ref, field)
    versions = versions.filter(**{f"{parent}__team": team, f"{parent}__name": name})
    found = versions.filter(version=number).first() if number else versions.order_by("-version").first()
    if found is None:
        kind = versions.model._meta.verbose_name
        raise NotFound(f"No {kind} '{ref}' in team '{team.slug}'.", fields={field: f"no such {kind}"})
    return found


def next_version_number(parent) -> int:
    """Call with `parent` locked (select_for_update) so two uploads never share a number."""
    return (parent.versions.aggregate(top=Max("version"))["top"] or 0) + 1


class NamedTeamObject(models.Model):
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="%(app_label)s")
    name = models.CharField(max_length=100)
    description = models.TextField(blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        abstract = True
        constraints = [models.UniqueConstraint(fields=["team", "name"], name="%(app_label)s_unique_name")]

    def __str__(self):
        return f"{self.team}/{self.name}"


class ImmutableVersion(models.Model):
    """Subclasses add the FK to their NamedTeamObject (related_name="versions") and a
    unique (that FK, version) constraint; rows are written once and never updated."""

    version = models.PositiveIntegerField()
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        abstract = True
        ordering = ["-version"]
