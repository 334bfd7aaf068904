from drf_spectacular.utils import extend_schema
from rest_framework import generics, status
from rest_framework.response import Response

from fluxrl.api.base import validated
from fluxrl.runs.api.views import RunReportMixin

from .. import services
from .serializers import IngestResultSerializer, MetricBatchSerializer, MetricsQuerySerializer, MetricsSerializer


class RunMetricsView(RunReportMixin, generics.GenericAPIView):
    serializer_class = MetricsSerializer

    @extend_schema(parameters=[MetricsQuerySerializer], summary="Read metric series, downsampled")
    def get(self, request, pk):
        query = validated(MetricsQuerySerializer, request.query_params)
        keys = [k.strip() for k in query.get("keys", "").split(",") if k.strip()]
        run = self.get_run()
        series = services.read_series(run, keys, query.get("since_step"), query["max_points"])
        return Response({"run": run.pk, "series": series})

    @extend_schema(request=MetricBatchSerializer, responses={201: IngestResultSerializer},
                   summary="Ingest a batch of metric points (idempotent by run, key, step)")
    def post(self, request, pk):
        run = self.get_run()
        body = request.data if isinstance(request.data, dict) else {}
        received = services.ingest_points(run, body.get("points"))
        return Response({"received": received}, status=status.HTTP_201_CREATED)
