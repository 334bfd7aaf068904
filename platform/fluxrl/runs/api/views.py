from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.http import StreamingHttpResponse
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import generics, status
from rest_framework.response import Response
from rest_framework.settings import api_settings

from fluxrl.accounts.models import RunToken
from fluxrl.accounts.services import create_run_token, renew_run_token, visible_teams
from fluxrl.api.base import TeamScopedMixin, is_schema_generation, validated
from fluxrl.api.parsers import YAML_MEDIA_TYPES, YAML_PARSERS
from fluxrl.api.permissions import RunWorkerOrTeamUser

from .. import exports, preview, services
from ..models import Checkpoint, Run, Sample
from .serializers import (
    CheckpointSerializer,
    ModelDownloadQuerySerializer,
    ModelExportSerializer,
    PromptPreviewRequestSerializer,
    PromptPreviewSerializer,
    RunCreateSerializer,
    RunDetailSerializer,
    RunListQuerySerializer,
    RunSerializer,
    RunStatusReportSerializer,
    RunStatusSerializer,
    RunTokenSerializer,
    RunUpdateSerializer,
    SampleBatchSerializer,
    SavedModelSerializer,
    SaveModelSerializer,
    SampleSerializer,
    SinceStepQuerySerializer,
    StoredCountSerializer,
)


class RunMixin(TeamScopedMixin):
    queryset = Run.objects.select_related("team", "owner", "dataset_version__dataset", "reward_version__function",
                                         "environment_version__environment").prefetch_related("tags")
    serializer_class = RunSerializer


class RunListView(RunMixin, generics.ListAPIView):
    parser_classes = [*api_settings.DEFAULT_PARSER_CLASSES, *YAML_PARSERS]  # a spec file can be posted as is

    def get_queryset(self):
        query = validated(RunListQuerySerializer, self.request.query_params) if not is_schema_generation(self) else {}
        return services.filter_runs(super().get_queryset(), **query)

    @extend_schema(parameters=[RunListQuerySerializer])
    def get(self, request):
        return super().get(request)

    @extend_schema(
        request={"application/json": RunCreateSerializer, **{media: OpenApiTypes.OBJECT for media in YAML_MEDIA_TYPES}},
        responses={201: RunDetailSerializer}, summary="Submit a run",
        description="JSON: `{spec, team?, tags?, notes?}`. YAML: the spec itself (a spec file as is), or that "
        "same envelope with a `spec:` key. Anchors/aliases are refused.")
    def post(self, request):
        body = request.data
        if request.content_type.partition(";")[0].strip().lower() in YAML_MEDIA_TYPES and not self.is_envelope(body):
            body = {"spec": body}  # the bare spec, as in `curl --data-binary @spec.yaml` (README)
        data = validated(RunCreateSerializer, body)
        team = self.team_for_new_object(data.get("team"))
        run = services.submit_run(team, request.user, data["spec"], data["tags"], data["notes"])
        return Response(RunDetailSerializer(self.queryset.get(pk=run.pk)).data, status=status.HTTP_201_CREATED)

    @staticmethod
    def is_envelope(body: dict) -> bool:
        # a spec has no `spec` field, so a spec that names one is still checked (and refused) as a spec
        return "spec" in body and body.keys() <= RunCreateSerializer().fields.keys()


class RunDetailView(RunMixin, generics.RetrieveAPIView):
    serializer_class = RunDetailSerializer

    @extend_schema(request=RunUpdateSerializer, responses={200: RunDetailSerializer}, summary="Edit tags and notes")
    def patch(self, request, pk):
        services.update_run(self.get_object(), **validated(RunUpdateSerializer, request.data))
        return Response(RunDetailSerializer(self.get_object()).data)


class RunCancelView(RunMixin, generics.GenericAPIView):
    serializer_class = RunStatusSerializer

    @extend_schema(request=None, responses={200: RunStatusSerializer})
    def post(self, request, pk):
        return Response(RunStatusSerializer(services.cancel_run(self.get_object())).data)


class RunResumeView(RunMixin, generics.GenericAPIView):
    serializer_class = RunStatusSerializer

    @extend_schema(request=None, responses={200: RunStatusSerializer},
                   summary="Queue a failed or cancelled run again, from its newest checkpoint (409 if none)")
    def post(self, request, pk):
        return Response(RunStatusSerializer(services.resume_run(self.get_object())).data)


class RunTokenView(RunMixin, generics.GenericAPIView):
    serializer_class = RunTokenSerializer

    @extend_schema(request=None, responses={201: RunTokenSerializer}, summary="Create a run token for a worker")
    def post(self, request, pk):
        run = self.get_object()
        if run.is_terminal:
            raise services.IllegalTransition(f"The run has {run.status}; it takes no more reports.")
        # it ends with the minter's rights: their membership, the API token they used
        token, key = create_run_token(run, minted_by=request.user, minted_with=request.auth)
        token.key = key
        return Response(RunTokenSerializer(token).data, status=status.HTTP_201_CREATED)


class RunReportMixin:
    """Endpoints under /api/runs/<pk>/ that workers post to: the run's own token may
    use them, and so may a team user (an API token needs the write scope to post)."""

    permission_classes = [RunWorkerOrTeamUser]

    @property
    def max_body_bytes(self):
        return settings.FLUXRL_INGEST_MAX_BYTES

    def get_run(self) -> Run:
        if isinstance(self.request.auth, RunToken):
            return self.request.auth.run  # the permission already matched it to the URL
        runs = Run.objects.filter(team__in=visible_teams(self.request.user, self.request.auth))
        return get_object_or_404(runs, pk=self.kwargs["pk"])

    def since_step(self, queryset):
        since = validated(SinceStepQuerySerializer, self.request.query_params).get("since_step")
        return queryset if since is None else queryset.filter(step__gt=since)


class RunStatusView(RunReportMixin, generics.GenericAPIView):
    serializer_class = RunStatusSerializer

    def get(self, request, pk):
        return Response(RunStatusSerializer(self.get_run()).data)

    @extend_schema(request=RunStatusReportSerializer, responses={200: RunStatusSerializer},
                   summary="Report a status change or heartbeat (the reply carries cancel_requested)")
    def post(self, request, pk):
        data = validated(RunStatusReportSerializer, request.data)
        token = request.auth if isinstance(request.auth, RunToken) else None
        run = services.report_status(self.get_run(), data, from_run_token=token is not None,
                                     from_dispatcher=token is not None and token.minted_by_id is None)
        if isinstance(request.auth, RunToken) and not run.is_terminal:
            renew_run_token(request.auth)
        return Response(RunStatusSerializer(run).data)


class RunSamplesView(RunReportMixin, generics.ListAPIView):
    serializer_class = SampleSerializer

    def get_queryset(self):
        return Sample.objects.none() if is_schema_generation(self) else self.since_step(self.get_run().samples.all())

    @extend_schema(parameters=[SinceStepQuerySerializer])
    def get(self, request, pk):
        return super().get(request)

    @extend_schema(request=SampleBatchSerializer, responses={201: StoredCountSerializer})
    def post(self, request, pk):
        run = self.get_run()
        samples = validated(SampleBatchSerializer, request.data)["samples"]
        return Response({"received": services.add_samples(run, samples)}, status=status.HTTP_201_CREATED)


class RunCheckpointsView(RunReportMixin, generics.ListAPIView):
    serializer_class = CheckpointSerializer

    def get_queryset(self):
        return Checkpoint.objects.none() if is_schema_generation(self) else self.get_run().checkpoints.all()

    @extend_schema(request=CheckpointSerializer, responses={201: CheckpointSerializer})
    def post(self, request, pk):
        run = self.get_run()
        checkpoint = services.add_checkpoint(run, **validated(CheckpointSerializer, request.data))
        return Response(CheckpointSerializer(checkpoint).data, status=status.HTTP_201_CREATED)


class RunExportsView(RunMixin, generics.GenericAPIView):
    serializer_class = ModelExportSerializer
    pagination_class = None

    @extend_schema(responses={200: ModelExportSerializer(many=True)},
                   summary="The run's weights that can be downloaded: the final model, then checkpoints (newest first)")
    def get(self, request, pk):
        return Response(ModelExportSerializer(exports.exportable(self.get_object()), many=True).data)


async def _async_chunks(chunks):
    """A sync generator's chunks, each read in a worker thread: under ASGI, Django reads a
    sync iterator to the end into a list before sending it."""
    end = object()
    try:
        while (chunk := await sync_to_async(next, thread_sensitive=False)(chunks, end)) is not end:
            yield chunk
    finally:
        await sync_to_async(chunks.close, thread_sensitive=False)()


class RunModelView(RunMixin, generics.GenericAPIView):
    serializer_class = ModelExportSerializer

    @extend_schema(parameters=[ModelDownloadQuerySerializer], summary="Download the run's weights as a Hugging "
                   "Face folder (safetensors, config, tokenizer) in a .tar.gz, .zip or .tar; part=adapter: a LoRA "
                   "run's adapter alone, as a PEFT folder",
                   responses={(200, "application/gzip"): OpenApiTypes.BINARY,
                              404: OpenApiResponse(description="no such run, or no such weights (the message says "
                                                               "what the run has)"),
                              409: OpenApiResponse(description="checkpoint=final while the run has not ended")})
    def get(self, request, pk):
        run = self.get_object()
        query = validated(ModelDownloadQuerySerializer, request.query_params)
        archive = exports.open_archive(exports.find_export(run, query["checkpoint"], query["part"]), query["archive"])
        chunks = _async_chunks(archive.chunks) if isinstance(request._request, ASGIRequest) else archive.chunks
        response = StreamingHttpResponse(chunks, content_type=archive.content_type)
        response._resource_closers.append(archive.close)  # the files, even if no chunk was ever read
        response["Content-Disposition"] = f'attachment; filename="{archive.filename}"'
        if archive.length is not None:
            response["Content-Length"] = str(archive.length)
        return response


class RunModelSaveView(RunMixin, generics.GenericAPIView):
    serializer_class = SaveModelSerializer

    @extend_schema(request=SaveModelSerializer, responses={201: SavedModelSerializer},
                   summary="Save the run's final model or a checkpoint's as a team model (model:<name>)")
    def post(self, request, pk):
        run = self.get_object()  # another team's run is missing, whatever the body says
        data = validated(SaveModelSerializer, request.data)
        version = exports.save_as_team_model(run, request.user, data["checkpoint"], data["name"], data["description"])
        return Response(SavedModelSerializer(version).data, status=status.HTTP_201_CREATED)


class PromptPreviewView(TeamScopedMixin, generics.GenericAPIView):
    """A row of the spec's dataset (or the row given) as the spec's model will see it."""

    serializer_class = PromptPreviewRequestSerializer

    @extend_schema(
        request=PromptPreviewRequestSerializer, summary="Preview the prompt a spec's model sees, and its tokens",
        description="Renders `row` (default: the first row of `spec.task.dataset`) with the spec's "
        "`task.prompt_format`, `task.prompt_template` and `task.system_prompt` through the model folder's own "
        "tokenizer and chat template, as the engine will. 400s name the field at fault (`spec.model.path`: no "
        "tokenizer; `spec.task.prompt_format`: a chat row on a model without a chat template; "
        "`spec.task.prompt_template`: a template that fails on the row; `spec.task.dataset`, `row`).",
        responses={
            200: PromptPreviewSerializer,
            429: OpenApiResponse(description="FLUXRL_PROMPT_PREVIEW_MAX_CONCURRENT previews are being made in this "
                                             "web process: retry after Retry-After"),
            501: OpenApiResponse(description="this server has no tokenizer libraries (a web-only install)"),
        },
        parameters=[OpenApiParameter("Retry-After", OpenApiTypes.INT, OpenApiParameter.HEADER, response=[429],
                                     description="seconds to wait before trying again")])
    def post(self, request):
        data = validated(PromptPreviewRequestSerializer, request.data)
        team = self.team_for_new_object(data.get("team"))
        result = preview.preview_prompt(team, data["spec"], data.get("row"))
        return Response(PromptPreviewSerializer(result).data)
