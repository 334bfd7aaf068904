from django.db.models import Max, Value
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import generics, status
from rest_framework.response import Response

from fluxrl.api.base import TeamScopedMixin, VersionsMixin, validated
from fluxrl.datasets.services import get_version as get_dataset_version
from fluxrl.errors import NotFound

from .. import services
from ..models import RewardFunction, RewardVersion
from .serializers import (
    RewardCreateSerializer,
    RewardFunctionSerializer,
    RewardTryAnySerializer,
    RewardTryVersionSerializer,
    RewardVersionCreateSerializer,
    RewardVersionSerializer,
    TryResultSerializer,
)


class RewardFunctionMixin(TeamScopedMixin):
    queryset = RewardFunction.objects.select_related("team").annotate(
        latest_version=Max("versions__version"), builtin=Value(False)).order_by("name")
    serializer_class = RewardFunctionSerializer


class RewardListView(RewardFunctionMixin, generics.ListAPIView):
    """Built-ins first, then your teams' functions."""

    def list(self, request):
        builtins = [{**item, "builtin": True, "id": None, "team": None, "latest_version": None, "created_at": None}
                    for item in services.builtin_catalog()]
        page = self.paginate_queryset(builtins + list(self.get_queryset()))
        return self.get_paginated_response(self.get_serializer(page, many=True).data)

    @extend_schema(request=RewardCreateSerializer, responses={201: RewardVersionSerializer})
    def post(self, request):
        data = dict(validated(RewardCreateSerializer, request.data))
        team = self.team_for_new_object(data.pop("team", None))
        version = services.create_function(team, request.user, **data)
        return Response(RewardVersionSerializer(version).data, status=status.HTTP_201_CREATED)


class RewardDetailView(RewardFunctionMixin, generics.RetrieveAPIView):
    pass


class RewardVersionsMixin(VersionsMixin):
    queryset = RewardVersion.objects.select_related("function", "created_by")
    serializer_class = RewardVersionSerializer
    parent_model, parent_field = RewardFunction, "function"


class RewardVersionListView(RewardVersionsMixin, generics.ListAPIView):
    @extend_schema(request=RewardVersionCreateSerializer, responses={201: RewardVersionSerializer})
    def post(self, request, pk):
        code = validated(RewardVersionCreateSerializer, request.data)["code"]
        version = services.add_version(self.parent(), request.user, code)
        return Response(RewardVersionSerializer(version).data, status=status.HTTP_201_CREATED)


class RewardVersionDetailView(RewardVersionsMixin, generics.RetrieveAPIView):
    pass


# Try-it is bounded (services.try_code): 400 past FLUXRL_TRY_MAX_SECONDS of work, 429 past
# FLUXRL_TRY_MAX_CONCURRENT tries at once in this web process.
TRY_RESPONSES = {200: TryResultSerializer, 429: OpenApiResponse(
    description="FLUXRL_TRY_MAX_CONCURRENT tries are already scoring in this web process: retry after Retry-After")}
TRY_HEADERS = [OpenApiParameter("Retry-After", OpenApiTypes.INT, OpenApiParameter.HEADER, response=[429],
                                description="seconds to wait before trying again")]


def run_try(team, code: str, data: dict) -> Response:
    rows, rows_field = data.get("rows"), "rows"
    if rows is None:
        dataset = get_dataset_version(team, data["dataset"], field="dataset")
        rows, rows_field = services.rows_from_dataset(dataset, data["n"], data.get("completions")), "n"
    outcome = services.try_code(code, rows, timeout_s=data.get("timeout_s"), memory_mb=data["memory_mb"],
                                rows_field=rows_field)
    return Response(TryResultSerializer(outcome).data)


class RewardTryView(RewardVersionsMixin, generics.GenericAPIView):
    """Score rows with a saved function (its newest version unless `version` is given)."""

    serializer_class = RewardTryVersionSerializer

    @extend_schema(responses=TRY_RESPONSES, parameters=TRY_HEADERS, operation_id="rewards_try_function")
    def post(self, request, pk):
        data = validated(RewardTryVersionSerializer, request.data)
        versions = self.get_queryset()
        version = (versions.filter(version=data["version"]) if "version" in data else versions.order_by("-version")).first()
        if version is None:
            raise NotFound(f"No version {data.get('version')} of this reward function.")
        team = self.team_for_new_object(data["team"]) if data.get("team") else version.function.team
        return run_try(team, version.code, data)


class RewardTryAnyView(TeamScopedMixin, generics.GenericAPIView):
    """Score rows with a built-in, a saved function by reference, or unsaved code."""

    serializer_class = RewardTryAnySerializer

    @extend_schema(responses=TRY_RESPONSES, parameters=TRY_HEADERS, operation_id="rewards_try_code")
    def post(self, request):
        data = validated(RewardTryAnySerializer, request.data)
        needs_team = "dataset" in data or data.get("function") not in (None, *services.BUILTIN_REWARDS)
        team = self.team_for_new_object(data.get("team")) if needs_team else None
        code = data.get("code") or services.code_for(team, data["function"])
        return run_try(team, code, data)
