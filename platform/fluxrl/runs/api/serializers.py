from django.conf import settings
from rest_framework import serializers

from fluxrl.modelstore.models import StoredModelVersion

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
    environment = serializers.StringRelatedField(source="environment_version", allow_null=True,
                                                 help_text="task.environment's team environment as name@version, or "
                                                           "null for a built-in, inline code or none")

    class Meta:
        model = Run
        fields = ["id", "team", "owner", "name", "status", "tags", "notes", "dataset", "reward", "environment",
                  "created_at",
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


class EnginePoolReportSerializer(serializers.Serializer):
    id = serializers.RegexField(r"^[0-9a-f]{12}-[0-9]+$", max_length=40)
    share = serializers.FloatField(min_value=0, max_value=1)
    fair_share = serializers.FloatField(min_value=0, max_value=1)


ENGINE_ONLY = " (the run's own run token only: 403 with a person's session or API token)"


class RunStatusReportSerializer(serializers.Serializer):
    """A status report. The fields that describe the engine are taken from the run's own run
    token only (runs.services.report_status, ENGINE_FIELDS)."""

    status = serializers.ChoiceField(choices=WORKER_STATUSES, help_text="the current status again = heartbeat")
    failure_reason = serializers.CharField(default="", allow_blank=True)
    worker_host = serializers.CharField(required=False, max_length=255, help_text="the engine's host" + ENGINE_ONLY)
    worker_pid = serializers.IntegerField(required=False, min_value=0, max_value=MAX_INT,
                                          help_text="the engine's process id" + ENGINE_ONLY)
    resumed_from_step = serializers.IntegerField(
        required=False, min_value=-1, max_value=MAX_STEP,
        help_text="with the first 'running' of an engine started with --resume: the checkpoint step it continues "
                  "after (-1: none found, it starts over); the platform drops the points and samples after it"
                  + ENGINE_ONLY)
    engine_pools = EnginePoolReportSerializer(
        many=True, required=False, max_length=64,
        help_text="rollout.share_engines: the shared engine pools the run is on, with its measured and fair share"
                  + ENGINE_ONLY)


class RunStatusSerializer(serializers.ModelSerializer):
    class Meta:
        model = Run
        fields = ["id", "status", "cancel_requested", "heartbeat_at", "started_at", "finished_at"]
        read_only_fields = fields


class SampleSerializer(serializers.ModelSerializer):
    class Meta:
        model = Sample
        fields = ["id", "uid", "step", "prompt", "completion", "reward", "version_runs", "tokens", "length", "error",
                  "episode", "created_at"]
        read_only_fields = fields
        extra_kwargs = {"tokens": {"help_text": "each completion token's text, in order (one per token of "
                                                "version_runs); null for samples reported without it"},
                        "episode": {"help_text": "an agentic run's episode (turns, tool calls, end reason); "
                                                 "null for a single-turn sample"}}


class StrictStringField(serializers.CharField):
    """Text only: DRF's CharField would take 12 or 1.5 and store "12"/"1.5"."""

    default_error_messages = {"invalid": "must be a string"}

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class EpisodeTextField(serializers.CharField):
    """Text of an episode (generated, observed, a tool's output), kept as sent (the
    parser has already refused NUL characters, which PostgreSQL cannot store)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("allow_blank", True)
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)


class ObservationInSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=["tool", "user"])
    content = EpisodeTextField()


class ToolRecordInSerializer(serializers.Serializer):
    name = EpisodeTextField()
    arguments = serializers.JSONField(default=dict)
    output = EpisodeTextField(allow_null=True, default="")
    error = EpisodeTextField(allow_null=True, default=None)
    ms = serializers.FloatField(min_value=0, default=0.0)


class TurnInSerializer(serializers.Serializer):
    text = EpisodeTextField(help_text="the generated turn, decoded")
    generated = serializers.IntegerField(min_value=0, max_value=MAX_INT, help_text="generated (trained) tokens")
    observed = serializers.IntegerField(min_value=0, max_value=MAX_INT, default=0,
                                        help_text="observation tokens after it (masked out of the loss)")
    versions = serializers.ListField(
        child=serializers.ListField(child=serializers.IntegerField(min_value=0, max_value=MAX_INT), min_length=2,
                                    max_length=2),
        default=list, help_text="[[policy version, token count], ...] over the turn's generated tokens")
    observation = ObservationInSerializer(required=False, allow_null=True, default=None)
    tools = ToolRecordInSerializer(many=True, default=list)
    reward = serializers.FloatField(required=False, allow_null=True, default=0.0)


class EpisodeInSerializer(serializers.Serializer):
    """An agentic run's episode (task.environment), turn by turn, for the run page."""

    end_reason = serializers.CharField(max_length=64, help_text="why it ended: done, max_turns, max_episode_tokens, "
                                                                "max_model_len or environment_error")
    end_detail = EpisodeTextField(default="")
    turns = TurnInSerializer(many=True, max_length=1024)


class SampleInSerializer(serializers.Serializer):
    uid = serializers.CharField(required=False, max_length=64, help_text="makes retries idempotent")
    step = serializers.IntegerField(min_value=0, max_value=MAX_STEP)
    prompt = serializers.CharField(allow_blank=True, trim_whitespace=False)
    completion = serializers.CharField(allow_blank=True, trim_whitespace=False)
    reward = serializers.FloatField(required=False, allow_null=True)
    versions = serializers.ListField(child=serializers.IntegerField(min_value=0, max_value=MAX_INT), default=list,
                                     help_text="policy version of each completion token")
    tokens = serializers.ListField(
        child=StrictStringField(allow_blank=True, trim_whitespace=False, max_length=settings.FLUXRL_SAMPLE_MAX_TOKEN_CHARS),
        required=False, allow_null=True,
        help_text="each completion token's own text at real token boundaries (special tokens shown), one per "
                  "entry of versions; at most FLUXRL_SAMPLE_MAX_TOKENS tokens of FLUXRL_SAMPLE_MAX_TOKEN_CHARS characters")
    length = serializers.IntegerField(required=False, min_value=0, max_value=MAX_INT, help_text="default: len(versions)")
    error = serializers.CharField(required=False, allow_blank=True)
    episode = EpisodeInSerializer(required=False, allow_null=True,
                                  help_text="an agentic run's episode: its turns, tool calls and end reason")

    def validate_tokens(self, tokens):
        limit = settings.FLUXRL_SAMPLE_MAX_TOKENS
        if tokens is not None and len(tokens) > limit:
            raise serializers.ValidationError(f"at most {limit} tokens (got {len(tokens)})")
        return tokens

    def validate(self, attrs):
        tokens, versions = attrs.get("tokens"), attrs.get("versions") or []
        if tokens is not None and len(tokens) != len(versions):
            raise serializers.ValidationError({"tokens": f"one entry per token of versions: {len(tokens)} tokens "
                                                         f"for {len(versions)} versions"})
        return attrs


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


class PromptPreviewRequestSerializer(serializers.Serializer):
    spec = serializers.JSONField(help_text="the run spec: a mapping, or YAML/JSON text; only model and task are read")
    row = serializers.DictField(required=False, allow_null=True,
                                help_text="a dataset row ({prompt: ...}, or {messages: [...]}, with any fields the "
                                          "template uses); default: the first row of the spec's task.dataset")
    team = serializers.SlugField(required=False, help_text="whose datasets and run outputs; default: your only team")


class PromptPreviewSerializer(serializers.Serializer):
    format = serializers.ChoiceField(choices=["chat", "raw"], help_text="how the row became the model's input")
    text = serializers.CharField(help_text="the prompt exactly as the model's tokenizer encodes it")
    token_ids = serializers.ListField(child=serializers.IntegerField(), help_text="the first tokens' ids")
    tokens = serializers.ListField(child=serializers.CharField(), help_text="each of those tokens' own text "
                                                                         "(special tokens shown)")
    token_count = serializers.IntegerField(help_text="all of the prompt's tokens")
    truncated = serializers.BooleanField(help_text="token_ids and tokens stop before token_count")
    row = serializers.DictField(help_text="the row rendered (prompt and answer named as the engine names them)")


# --- exporting a run's model (runs/exports.py) --------------------------------------------


class ModelFileSerializer(serializers.Serializer):
    name = serializers.CharField()
    size = serializers.IntegerField(help_text="bytes")


class ModelExportSerializer(serializers.Serializer):
    checkpoint = serializers.CharField(help_text="'final', or the checkpoint's step: the value of ?checkpoint=")
    step = serializers.IntegerField(allow_null=True, help_text="steps trained into these weights")
    version = serializers.IntegerField(allow_null=True, help_text="the policy version (checkpoints)")
    size_bytes = serializers.IntegerField()
    files = serializers.SerializerMethodField()
    download = serializers.SerializerMethodField(help_text="GET it for a .tar.gz of the folder (&archive=zip or tar)")
    adapter_bytes = serializers.IntegerField(allow_null=True, help_text="model.lora: the adapter's bytes (else null)")
    adapter_download = serializers.SerializerMethodField(help_text="model.lora: the adapter alone as a PEFT folder "
                                                         "(else null)")

    def get_files(self, export) -> ModelFileSerializer(many=True):
        return [{"name": name, "size": size} for name, size in export.files]

    def get_download(self, export) -> str:
        return f"/api/runs/{export.run_id}/model/?checkpoint={export.checkpoint}"

    def get_adapter_download(self, export) -> str | None:
        return None if export.adapter is None else f"{self.get_download(export)}&part=adapter"


class ModelDownloadQuerySerializer(serializers.Serializer):
    checkpoint = serializers.CharField(default="final", max_length=40,
                                       help_text="'final' (when the run has ended) or a checkpoint's step")
    # not `format`: DRF reads ?format= as the renderer to use
    archive = serializers.ChoiceField(choices=["tar.gz", "zip", "tar"], default="tar.gz")
    part = serializers.ChoiceField(choices=["model", "adapter"], default="model", help_text="model: the whole "
                                   "model (a LoRA run's with the adapter merged in); adapter: a LoRA run's adapter "
                                   "alone, as a PEFT folder")


class SaveModelSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=100, help_text="the team model's name: a new name creates it, an "
                                                           "existing one gets a new version")
    checkpoint = serializers.CharField(default="final", max_length=40)
    description = serializers.CharField(default="", allow_blank=True, max_length=2000)


class SavedModelSerializer(serializers.ModelSerializer):
    """The team model version a run's weights were saved as (GET /api/models/<model>/ has the rest)."""

    name = serializers.CharField(source="model.name", read_only=True)
    ref = serializers.SerializerMethodField(help_text="use as model.path in a run spec")

    class Meta:
        model = StoredModelVersion
        fields = ["model", "name", "version", "ref", "kind", "architecture", "sha256", "size_bytes", "files"]
        read_only_fields = fields

    def get_ref(self, version) -> str:
        return f"model:{version.model.name}@{version.version}"
