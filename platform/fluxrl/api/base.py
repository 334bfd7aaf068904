from django.shortcuts import get_object_or_404

from fluxrl.accounts.services import pick_team, visible_teams


def is_schema_generation(view) -> bool:
    return getattr(view, "swagger_fake_view", False)  # drf-spectacular's fake request


class TeamScopedMixin:
    """Every queryset of a view narrowed to the requester's teams (and a token's team
    restriction), so another team's objects answer 404 as if they did not exist."""

    team_path = "team"  # lookup from the view's model to its Team

    def visible_teams(self):
        return visible_teams(self.request.user, self.request.auth)

    def get_queryset(self):
        queryset = super().get_queryset()
        if is_schema_generation(self):
            return queryset.none()
        return queryset.filter(**{f"{self.team_path}__in": self.visible_teams()})

    def team_for_new_object(self, slug: str | None):
        return pick_team(self.request.user, self.request.auth, slug)


class VersionsMixin(TeamScopedMixin):
    """Versions of one team object, at <pk>/versions/[<version>/]; 404 if the parent is
    not visible. Subclasses set queryset (of versions), parent_model and parent_field."""

    parent_model = None
    parent_field = ""
    lookup_field = "version"

    @property
    def team_path(self):
        return f"{self.parent_field}__team"

    def parent(self):
        return get_object_or_404(self.parent_model.objects.filter(team__in=self.visible_teams()), pk=self.kwargs["pk"])

    def get_queryset(self):
        queryset = super().get_queryset()
        return queryset if is_schema_generation(self) else queryset.filter(**{self.parent_field: self.parent()})


def validated(serializer_class, data, **context) -> dict:
    """Validate request data with a serializer and return its validated_data (400 otherwise)."""
    serializer = serializer_class(data=data, context=context)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data
