from django.conf import settings
from django.db.models import Count
from drf_spectacular.utils import extend_schema
from rest_framework import generics, status
from rest_framework.response import Response

from fluxrl.api.base import TeamScopedMixin, VersionsMixin, validated
from fluxrl.api.parsers import LimitedMultiPartParser

from .. import services
from ..models import StoredModel, StoredModelVersion
from .serializers import StoredModelSerializer, StoredModelUploadSerializer, StoredModelVersionSerializer


class StoredModelMixin(TeamScopedMixin):
    queryset = StoredModel.objects.select_related("team").prefetch_related("versions").annotate(
        version_count=Count("versions")).order_by("name")
    serializer_class = StoredModelSerializer


class StoredModelListView(StoredModelMixin, generics.ListAPIView):
    parser_classes = [LimitedMultiPartParser]

    @property
    def max_body_bytes(self):
        return settings.FLUXRL_MAX_MODEL_BYTES + 1024 * 1024  # the archive plus form fields

    @extend_schema(request={"multipart/form-data": StoredModelUploadSerializer},
                   responses={201: StoredModelVersionSerializer},
                   summary="Upload a model folder (.tar/.tar.gz/.zip) as a new model version")
    def post(self, request):
        data = dict(validated(StoredModelUploadSerializer, request.data))
        team = self.team_for_new_object(data.pop("team", None))
        version = services.upload_version(team, request.user, data["name"], data["file"], data["description"])
        return Response(StoredModelVersionSerializer(version).data, status=status.HTTP_201_CREATED)


class StoredModelDetailView(StoredModelMixin, generics.RetrieveAPIView):
    pass


class StoredModelVersionsMixin(VersionsMixin):
    queryset = StoredModelVersion.objects.select_related("model", "created_by")
    serializer_class = StoredModelVersionSerializer
    parent_model, parent_field = StoredModel, "model"


class StoredModelVersionListView(StoredModelVersionsMixin, generics.ListAPIView):
    pass


class StoredModelVersionDetailView(StoredModelVersionsMixin, generics.RetrieveAPIView):
    pass
