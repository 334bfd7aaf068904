from django.db.models import Max
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import generics, status
from rest_framework.response import Response

from fluxrl.api.base import TeamScopedMixin, VersionsMixin, validated
from fluxrl.errors import NotFound

from .. import services
from ..models import EnvironmentVersion, TeamEnvironment
from .serializers import (
    EnvironmentCreateSerializer,
    EnvironmentSerializer,
    EnvironmentTryAnySerializer,
    EnvironmentTryResultSerializer,
    EnvironmentTryVersionSerializer,
    EnvironmentVersionCreateSerializer,
    EnvironmentVersionSerializer,
)


class EnvironmentMixin(TeamScopedMixin):
    queryset = TeamEnvironment.objects.select_related("team").annotate(
        latest_version=Max("versions__version")).order_by("name")
    serializer_class = EnvironmentSerializer


class EnvironmentListView(EnvironmentMixin, generics.ListAPIView):
    """Your teams' environments (the built-ins, tools and guess_number, need no upload)."""

    @extend_schema(request=EnvironmentCreateSerializer, responses={201: EnvironmentVersionSerializer})
    def post(self, request):
        data = dict(validated(EnvironmentCreateSerializer, request.data))
        team = self.team_for_new_object(data.pop("team", None))
        version = services.create_environment(team, request.user, **data)
        return Response(EnvironmentVersionSerializer(version).data, status=status.HTTP_201_CREATED)


class EnvironmentDetailView(EnvironmentMixin, generics.RetrieveAPIView):
    pass


class EnvironmentVersionsMixin(VersionsMixin):
    queryset = EnvironmentVersion.objects.select_related("environment", "created_by")
    serializer_class = EnvironmentVersionSerializer
    parent_model, parent_field = TeamEnvironment, "environment"


class EnvironmentVersionListView(EnvironmentVersionsMixin, generics.ListAPIView):
    @extend_schema(request=EnvironmentVersionCreateSerializer, responses={201: EnvironmentVersionSerializer})
    def post(self, request, pk):
        code = validated(EnvironmentVersionCreateSerializer, request.data)["code"]
        version = services.add_version(self.parent(), request.user, code)
        return Response(EnvironmentVersionSerializer(version).data, status=status.HTTP_201_CREATED)


class EnvironmentVersionDetailView(EnvironmentVersionsMixin, generics.RetrieveAPIView):
    pass


TRY_RESPONSES = {200: EnvironmentTryResultSerializer, 429: OpenApiResponse(
    description="FLUXRL_TRY_MAX_CONCURRENT tries are already running in this web process: retry after Retry-After")}
TRY_HEADERS = [OpenApiParameter("Retry-After", OpenApiTypes.INT, OpenApiParameter.HEADER, response=[429],
                                description="seconds to wait before trying again")]
TRY_FIELDS = ("row", "turns", "params", "timeout_s", "memory_mb", "output_chars")


def run_try(code: str, data: dict) -> Response:
    outcome = services.try_code(code, **{name: data[name] for name in TRY_FIELDS})
    return Response(EnvironmentTryResultSerializer(outcome).data)


class EnvironmentTryView(EnvironmentVersionsMixin, generics.GenericAPIView):
    """Run one episode of a saved environment (its newest version unless `version` is given) in the sandbox."""

    serializer_class = EnvironmentTryVersionSerializer

    @extend_schema(responses=TRY_RESPONSES, parameters=TRY_HEADERS, operation_id="environments_try_saved")
    def post(self, request, pk):
        versions = self.get_queryset()  # another team's environment: 404 before the body is looked at
        data = validated(EnvironmentTryVersionSerializer, request.data)
        version = (versions.filter(version=data["version"]) if "version" in data else versions.order_by("-version")).first()
        if version is None:
            raise NotFound(f"No version {data.get('version')} of this environment.")
        return run_try(version.code, data)


class EnvironmentTryAnyView(TeamScopedMixin, generics.GenericAPIView):
    """Run one episode of a team environment by reference, or of unsaved code, in the sandbox."""

    serializer_class = EnvironmentTryAnySerializer

    @extend_schema(responses=TRY_RESPONSES, parameters=TRY_HEADERS, operation_id="environments_try_code")
    def post(self, request):
        data = validated(EnvironmentTryAnySerializer, request.data)
        if "code" in data:
            return run_try(data["code"], data)
        team = self.team_for_new_object(data.get("team"))
        return run_try(services.get_version(team, data["environment"]).code, data)
