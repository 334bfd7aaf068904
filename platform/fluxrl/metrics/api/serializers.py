from rest_framework import serializers


class MetricPointSerializer(serializers.Serializer):
    key = serializers.CharField(max_length=100, help_text="e.g. reward/mean (docs/architecture.md §5)")
    step = serializers.IntegerField(min_value=0)
    value = serializers.FloatField()
    time = serializers.FloatField(required=False, allow_null=True, help_text="wall clock, unix seconds (default: arrival)")


class MetricBatchSerializer(serializers.Serializer):
    """Checked in metrics.services.ingest_points (fast for 1000 points); this documents it."""

    points = MetricPointSerializer(many=True, help_text="at most 1000 points, body at most 1 MB")


class IngestResultSerializer(serializers.Serializer):
    received = serializers.IntegerField(help_text="distinct (key, step) in the batch; already stored ones were skipped")


class MetricsQuerySerializer(serializers.Serializer):
    keys = serializers.CharField(required=False, help_text="comma-separated keys; default: all")
    since_step = serializers.IntegerField(required=False, help_text="only steps after this one")
    max_points = serializers.IntegerField(default=1000, min_value=1, help_text="per series; downsampled beyond")


class SeriesSerializer(serializers.Serializer):
    step = serializers.ListField(child=serializers.IntegerField())
    value = serializers.ListField(child=serializers.FloatField())
    time = serializers.ListField(child=serializers.FloatField())
    count = serializers.IntegerField(help_text="points stored in range, before downsampling")
    downsampled = serializers.BooleanField()


class MetricsSerializer(serializers.Serializer):
    run = serializers.IntegerField()
    series = serializers.DictField(child=SeriesSerializer())
