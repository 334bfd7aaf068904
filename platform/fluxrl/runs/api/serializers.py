from rest_framework import serializers

from ..models import MAX_INT, MAX_STEP, Checkpoint, Run, RunStatus, Sample

WORKER_STATUSES = [RunStatus.STARTING, RunStatus.RUNNING, RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED]


class RunSerializer(serializers.ModelSerializer):
    team = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    owner = serializers.SlugRelatedField(slug_field="username", read_only=True)
    tags = serializers.SlugRelatedField(slug_field="name", many=True, read_only=True)
    dataset = serializers.StringRelatedField(source="dataset_version", allow_null=True,
                                             help_text="name@version, or null for gen:<name>")
    reward = serializers.StringRelatedField(source="reward_version", allow_null=True,
                                            help_text="name@version, or null for a built-in or inline code")

    class Meta:
        model = Run
        fields = ["id", "team", "owner", "name", "status", "tags", "notes", "dataset", "reward", "created_at",
                  "started_at", "finished_at", "failure_reason", "cancel_requested", "worker_host", "worker_pid",
                  "heartbeat_at"]
        read_only_fields = fields


class RunDetailSerializer(RunSerializer):
    class Meta(RunSerializer.Meta):
        fields = [*RunSerializer.Meta.fields, "spec", "resolved_spec"]
        read_only_fields = fields


class RunCreateSerializer(serializers.Serializer):
    spec = serializers.JSONField(help_text="the run spec: a mapping, or YAML/JSON text (see workers.spec)")
    team = serializers.SlugField(required=False)
    tags = serializers.ListField(child=serializers.CharField(max_length=50), default=list)
    notes = serializers.CharField(default="", allow_blank=True)


class RunUpdateSerializer(serializers.Serializer):
    tags = serializers.ListField(child=serializers.CharField(max_length=50), required=False)
    notes = serializers.CharField(required=False, allow_blank=True)


class RunListQuerySerializer(serializers.Serializer):
    status = serializers.CharField(required=False, help_text="one status or several, comma-separated")
    tag = serializers.CharField(required=False)
    owner = serializers.CharField(required=False, help_text="username")
    team = serializers.SlugField(required=False)
    q = serializers.CharField(required=False, help_text="search in name and notes")


class RunStatusReportSerializer(serializers.Serializer):
    status = serializers.ChoiceField(choices=WORKER_STATUSES, help_text="the current status again = heartbeat")
    failure_reason = serializers.CharField(default="", allow_blank=True)
    worker_host = serializers.CharField(required=False, max_length=255)
    worker_pid = serializers.IntegerField(required=False, min_value=0, max_value=MAX_INT)


class RunStatusSerializer(serializers.ModelSerializer):
    class Meta:
        model = Run
        fields = ["id", "status", "cancel_requested", "heartbeat_at", "started_at", "finished_at"]
        read_only_fields = fields


class SampleSerializer(serializers.ModelSerializer):
    class Meta:
        model = Sample
        fields = ["id", "uid", "step", "prompt", "completion", "reward", "version_runs", "length", "error", "created_at"]
        read_only_fields = fields


class SampleInSerializer(serializers.Serializer):
    uid = serializers.CharField(required=False, max_length=64, help_text="makes retries idempotent")
    step = serializers.IntegerField(min_value=0, max_value=MAX_STEP)
    prompt = serializers.CharField(allow_blank=True, trim_whitespace=False)
    completion = serializers.CharField(allow_blank=True, trim_whitespace=False)
    reward = serializers.FloatField(required=False, allow_null=True)
    versions = serializers.ListField(child=serializers.IntegerField(min_value=0, max_value=MAX_INT), default=list,
                                     help_text="policy version of each completion token")
    length = serializers.IntegerField(required=False, min_value=0, max_value=MAX_INT, help_text="default: len(versions)")
    error = serializers.CharField(required=False, allow_blank=True)


class SampleBatchSerializer(serializers.Serializer):
    samples = SampleInSerializer(many=True)


class StoredCountSerializer(serializers.Serializer):
    received = serializers.IntegerField()


class CheckpointSerializer(serializers.ModelSerializer):
    class Meta:
        model = Checkpoint
        fields = ["id", "step", "version", "path", "created_at"]
        read_only_fields = ["id", "created_at"]
        extra_kwargs = {"step": {"min_value": 0, "max_value": MAX_STEP}, "version": {"min_value": 0, "max_value": MAX_INT}}


class SinceStepQuerySerializer(serializers.Serializer):
    since_step = serializers.IntegerField(required=False, help_text="only steps after this one")


class RunTokenSerializer(serializers.Serializer):
    run = serializers.IntegerField(source="run_id")
    prefix = serializers.CharField()
    expires_at = serializers.DateTimeField(allow_null=True)
    key = serializers.CharField(help_text="shown once; give it to the worker as its bearer token")
