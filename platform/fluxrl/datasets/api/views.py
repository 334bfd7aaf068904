from django.conf import settings
from django.db.models import Count
from django.http import FileResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiResponse, extend_schema
from rest_framework import generics, status
from rest_framework.response import Response

from fluxrl.api.base import TeamScopedMixin, VersionsMixin, validated
from fluxrl.api.parsers import LimitedMultiPartParser
from fluxrl.errors import NotFound

from .. import imports, services
from ..models import Dataset, DatasetVersion
from .serializers import (
    DatasetGenerateSerializer,
    DatasetImportSerializer,
    DatasetSerializer,
    DatasetUploadSerializer,
    DatasetVersionSerializer,
    GeneratorSerializer,
    ImportFoldersQuerySerializer,
    ImportFoldersSerializer,
    PreviewQuerySerializer,
    PreviewSerializer,
)


class DatasetMixin(TeamScopedMixin):
    queryset = Dataset.objects.select_related("team").prefetch_related("versions").annotate(
        version_count=Count("versions")).order_by("name")
    serializer_class = DatasetSerializer


class DatasetListView(DatasetMixin, generics.ListAPIView):
    parser_classes = [LimitedMultiPartParser]

    @property
    def max_body_bytes(self):
        return settings.FLUXRL_MAX_UPLOAD_BYTES + 1024 * 1024  # the file plus form fields

    @extend_schema(request={"multipart/form-data": DatasetUploadSerializer}, responses={201: DatasetVersionSerializer},
                   summary="Upload a JSONL, CSV, Parquet or Arrow file, or a save_to_disk folder archive, as a new "
                           "dataset version")
    def post(self, request):
        data = dict(validated(DatasetUploadSerializer, request.data))
        team = self.team_for_new_object(data.pop("team", None))
        version = services.upload_version(team, request.user, data.pop("name"), data.pop("file"),
                                          fmt=data.pop("format", None), **data)
        return Response(DatasetVersionSerializer(version).data, status=status.HTTP_201_CREATED)


class DatasetDetailView(DatasetMixin, generics.RetrieveAPIView):
    pass


class DatasetImportView(TeamScopedMixin, generics.GenericAPIView):
    """Hugging Face datasets folders (save_to_disk) from the team's folder under the
    server's import root (FLUXRL_DATASET_IMPORT_ROOT/<team slug>/)."""

    serializer_class = DatasetImportSerializer

    @extend_schema(parameters=[ImportFoldersQuerySerializer], responses={200: ImportFoldersSerializer},
                   summary="List the save_to_disk folders the team may import")
    def get(self, request):
        query = validated(ImportFoldersQuerySerializer, request.query_params)
        team = self.team_for_new_object(query.get("team"))
        return Response(ImportFoldersSerializer(imports.import_folders(team)).data)

    @extend_schema(responses={201: DatasetVersionSerializer},
                   summary="Import a save_to_disk folder from the team's import folder as a new dataset version",
                   examples=[OpenApiExample("A DatasetDict's train split", request_only=True, value={
                       "name": "gsm8k", "path": "gsm8k", "split": "train", "prompt_field": "question",
                       "answer_field": "answer"})])
    def post(self, request):
        data = dict(validated(DatasetImportSerializer, request.data))
        team = self.team_for_new_object(data.pop("team", None))
        version = services.import_folder(team, request.user, data.pop("name"), data.pop("path"), **data)
        return Response(DatasetVersionSerializer(version).data, status=status.HTTP_201_CREATED)


class GeneratorListView(generics.ListAPIView):
    serializer_class = GeneratorSerializer
    pagination_class = None

    def get_queryset(self):
        return services.generator_catalog()


class DatasetGenerateView(TeamScopedMixin, generics.GenericAPIView):
    serializer_class = DatasetGenerateSerializer

    @extend_schema(responses={201: DatasetVersionSerializer}, summary="Create a dataset version from a built-in generator")
    def post(self, request):
        data = dict(validated(DatasetGenerateSerializer, request.data))
        team = self.team_for_new_object(data.pop("team", None))
        version = services.generate_version(team, request.user, **data)
        return Response(DatasetVersionSerializer(version).data, status=status.HTTP_201_CREATED)


class DatasetVersionsMixin(VersionsMixin):
    queryset = DatasetVersion.objects.select_related("dataset", "created_by")
    serializer_class = DatasetVersionSerializer
    parent_model, parent_field = Dataset, "dataset"


class DatasetVersionListView(DatasetVersionsMixin, generics.ListAPIView):
    pass


class DatasetVersionDetailView(DatasetVersionsMixin, generics.RetrieveAPIView):
    pass


class DatasetPreviewView(DatasetVersionsMixin, generics.GenericAPIView):
    @extend_schema(parameters=[PreviewQuerySerializer], responses={200: PreviewSerializer})
    def get(self, request, pk, version):
        query = validated(PreviewQuerySerializer, request.query_params)
        found = self.get_object()
        rows = services.read_rows(found, query["offset"], query["limit"])
        return Response(PreviewSerializer({**query, "row_count": found.row_count, "rows": rows}).data)


class DatasetDownloadView(DatasetVersionsMixin, generics.GenericAPIView):
    @extend_schema(responses={(200, "application/x-ndjson"): OpenApiResponse(OpenApiTypes.BINARY, "normalized JSONL")})
    def get(self, request, pk, version):
        found = self.get_object()
        if not found.path.exists():
            raise NotFound(f"The stored file of {found} is missing.")
        return FileResponse(found.path.open("rb"), as_attachment=True, filename=f"{found.dataset.name}-v{found.version}.jsonl",
                            content_type="application/x-ndjson")
