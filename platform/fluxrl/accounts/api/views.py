from django.db.models import OuterRef, Subquery
from drf_spectacular.utils import extend_schema
from rest_framework import generics, status
from rest_framework.response import Response

from fluxrl.api.base import validated
from fluxrl.rewards.services import sandbox_state

from .. import services
from ..models import ApiToken, Membership
from .serializers import (
    ApiTokenCreatedSerializer,
    ApiTokenCreateSerializer,
    ApiTokenSerializer,
    MemberCreateSerializer,
    MemberSerializer,
    MeSerializer,
    ReportDefaultsSerializer,
    TeamCreateSerializer,
    TeamSerializer,
)


def teams_with_role(request):
    my_role = Membership.objects.filter(team=OuterRef("pk"), user=request.user).values("role")[:1]
    return services.visible_teams(request.user, request.auth).annotate(role=Subquery(my_role)).order_by("slug")


class MeView(generics.GenericAPIView):
    serializer_class = MeSerializer

    def get(self, request):
        return Response(MeSerializer({"username": request.user.username, "teams": teams_with_role(request),
                                      "sandbox": sandbox_state()}).data)


class TeamListView(generics.ListAPIView):
    serializer_class = TeamSerializer

    def get_queryset(self):
        return teams_with_role(self.request)

    @extend_schema(request=TeamCreateSerializer, responses={201: TeamSerializer})
    def post(self, request):
        team = services.create_team(request.user, **validated(TeamCreateSerializer, request.data))
        return Response(TeamSerializer(teams_with_role(request).get(pk=team.pk)).data, status=status.HTTP_201_CREATED)


class TeamDetailView(generics.RetrieveAPIView):
    serializer_class = TeamSerializer
    lookup_field = "slug"

    def get_queryset(self):
        return teams_with_role(self.request)


class TeamReportDefaultsView(generics.GenericAPIView):
    """The team's default exporters: any member reads them, an admin sets them (PUT)."""

    serializer_class = ReportDefaultsSerializer

    def get_queryset(self):
        return services.visible_teams(self.request.user, self.request.auth)

    def get_object(self):  # (also what an OPTIONS request describes)
        return services.get_visible_team(self.request.user, self.request.auth, self.kwargs["slug"])

    def get(self, request, slug):
        team = self.get_object()
        return Response(ReportDefaultsSerializer({"team": team.slug, "report": team.report_defaults}).data)

    def put(self, request, slug):
        team = self.get_object()  # another team's: 404 before anything about the body
        report = validated(ReportDefaultsSerializer, request.data)["report"]
        team = services.set_report_defaults(team, request.user, report)
        return Response(ReportDefaultsSerializer({"team": team.slug, "report": team.report_defaults}).data)


class TeamMembersMixin:
    serializer_class = MemberSerializer

    def team(self):
        return services.get_visible_team(self.request.user, self.request.auth, self.kwargs["slug"])

    def get_queryset(self):
        return self.team().memberships.select_related("user", "team").order_by("user__username")


class TeamMemberListView(TeamMembersMixin, generics.ListAPIView):
    @extend_schema(request=MemberCreateSerializer, responses={201: MemberSerializer})
    def post(self, request, slug):
        membership = services.add_member(self.team(), request.user, **validated(MemberCreateSerializer, request.data))
        return Response(MemberSerializer(membership).data, status=status.HTTP_201_CREATED)


class TeamMemberDetailView(TeamMembersMixin, generics.RetrieveDestroyAPIView):
    lookup_field, lookup_url_kwarg = "user__username", "username"

    def perform_destroy(self, membership):
        services.remove_member(membership.team, self.request.user, membership.user.username)


class ApiTokenListView(generics.ListAPIView):
    serializer_class = ApiTokenSerializer

    def get_queryset(self):
        return ApiToken.objects.filter(user=self.request.user).select_related("team").order_by("-created_at")

    @extend_schema(request=ApiTokenCreateSerializer, responses={201: ApiTokenCreatedSerializer})
    def post(self, request):
        data = validated(ApiTokenCreateSerializer, request.data)
        team = services.get_visible_team(request.user, request.auth, data["team"]) if data.get("team") else None
        via = request.auth if isinstance(request.auth, ApiToken) else None
        token, key = services.create_api_token(
            request.user, data["name"], list(data["scopes"]), team=team, expires_at=data.get("expires_at"), via=via
        )
        token.key = key
        return Response(ApiTokenCreatedSerializer(token).data, status=status.HTTP_201_CREATED)


class ApiTokenDetailView(generics.RetrieveDestroyAPIView):
    serializer_class = ApiTokenSerializer

    def get_queryset(self):
        return ApiToken.objects.filter(user=self.request.user)

    def perform_destroy(self, instance):
        services.revoke_api_token(instance)  # kept (revoked) so lists show what existed
