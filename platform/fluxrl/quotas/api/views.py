from drf_spectacular.utils import extend_schema
from rest_framework import generics
from rest_framework.response import Response

from fluxrl.accounts.services import get_visible_team

from .. import services
from .serializers import TeamQuotaSerializer


class TeamQuotaView(generics.GenericAPIView):
    """A team's quotas: what it uses and what it may, with the asker's own (across their
    teams) and the team's organisation's (read-only; a platform admin sets them)."""

    serializer_class = TeamQuotaSerializer

    @extend_schema(summary="A team's quota use and limits")
    def get(self, request, slug):
        team = get_visible_team(request.user, request.auth, slug)  # 404 for a team that is not yours
        return Response(TeamQuotaSerializer({"team": team.slug, **services.usage_report(team, request.user)}).data)
