from rest_framework import serializers

from ..models import Dataset, DatasetVersion

MAX_ROWS = 2**31 - 1  # DatasetVersion.row_count is a 32-bit integer
BUILTIN_GENERATOR_HELP = "built-in generator: see GET /api/datasets/generators/"


class DatasetVersionSerializer(serializers.ModelSerializer):
    name = serializers.CharField(source="dataset.name", read_only=True)
    ref = serializers.CharField(source="__str__", read_only=True, help_text="use as task.dataset in a run spec")
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = DatasetVersion
        fields = ["dataset", "name", "version", "ref", "sha256", "size_bytes", "row_count", "columns", "source",
                  "source_name", "source_fields", "generator", "created_by", "created_at"]
        read_only_fields = fields


class DatasetSerializer(serializers.ModelSerializer):
    team = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    latest = serializers.SerializerMethodField()
    version_count = serializers.IntegerField(read_only=True)

    class Meta:
        model = Dataset
        fields = ["id", "team", "name", "description", "created_at", "version_count", "latest"]
        read_only_fields = fields

    def get_latest(self, dataset) -> DatasetVersionSerializer:
        latest = max(dataset.versions.all(), key=lambda v: v.version, default=None)  # prefetched
        return DatasetVersionSerializer(latest).data if latest else None


PROMPT_FIELD_HELP = "the source column (or JSON field) that holds the prompt; stored as 'prompt'"
ANSWER_FIELD_HELP = "the source column (or JSON field) that holds the answer; stored as 'answer'"
SPLIT_HELP = "for a folder holding a DatasetDict: which split (optional if it has one)"


class DatasetUploadSerializer(serializers.Serializer):
    file = serializers.FileField(help_text="JSONL (one JSON object a line), CSV with a header, Parquet, Arrow IPC "
                                           "(file or stream; Feather 2), or a save_to_disk folder as .zip/.tar/.tar.gz")
    name = serializers.CharField(max_length=100, help_text="a new name creates a dataset; an existing one a new version")
    team = serializers.SlugField(required=False, help_text="team slug; optional if you have one team")
    prompt_field = serializers.CharField(default="prompt", max_length=100, help_text=PROMPT_FIELD_HELP)
    answer_field = serializers.CharField(default="answer", max_length=100, help_text=ANSWER_FIELD_HELP)
    format = serializers.ChoiceField(choices=["jsonl", "csv", "parquet", "arrow", "hf_dataset"], required=False,
                                     help_text="default: from the file name (.jsonl .csv .parquet .arrow .feather "
                                               ".zip .tar .tar.gz)")
    split = serializers.CharField(default="", allow_blank=True, max_length=100, help_text=SPLIT_HELP)
    description = serializers.CharField(default="", allow_blank=True)


class DatasetImportSerializer(serializers.Serializer):
    path = serializers.CharField(max_length=1000, help_text="a save_to_disk folder, relative to your team's folder "
                                                            "under the server's FLUXRL_DATASET_IMPORT_ROOT")
    name = serializers.CharField(max_length=100, help_text="a new name creates a dataset; an existing one a new version")
    team = serializers.SlugField(required=False, help_text="team slug; optional if you have one team")
    split = serializers.CharField(default="", allow_blank=True, max_length=100, help_text=SPLIT_HELP)
    prompt_field = serializers.CharField(default="prompt", max_length=100, help_text=PROMPT_FIELD_HELP)
    answer_field = serializers.CharField(default="answer", max_length=100, help_text=ANSWER_FIELD_HELP)
    description = serializers.CharField(default="", allow_blank=True)


class ImportFolderSerializer(serializers.Serializer):
    path = serializers.CharField()
    splits = serializers.ListField(child=serializers.CharField(), help_text="empty for a single Dataset")


class ImportFoldersSerializer(serializers.Serializer):
    enabled = serializers.BooleanField(help_text="false: the server has no FLUXRL_DATASET_IMPORT_ROOT")
    folders = ImportFolderSerializer(many=True)


class ImportFoldersQuerySerializer(serializers.Serializer):
    team = serializers.SlugField(required=False, help_text="team slug; optional if you have one team")


class DatasetGenerateSerializer(serializers.Serializer):
    generator = serializers.CharField(help_text=BUILTIN_GENERATOR_HELP)
    name = serializers.CharField(max_length=100)
    team = serializers.SlugField(required=False)
    n = serializers.IntegerField(default=4000)
    seed = serializers.IntegerField(default=0)
    params = serializers.DictField(default=dict, help_text="generator parameters, e.g. {\"max_digits\": 3}")
    description = serializers.CharField(default="", allow_blank=True)


class GeneratorSerializer(serializers.Serializer):
    name = serializers.CharField()
    description = serializers.CharField()
    params = serializers.DictField(help_text="parameters and their defaults")


class PreviewSerializer(serializers.Serializer):
    offset = serializers.IntegerField()
    limit = serializers.IntegerField()
    row_count = serializers.IntegerField()
    rows = serializers.ListField(child=serializers.DictField())


class PreviewQuerySerializer(serializers.Serializer):
    offset = serializers.IntegerField(default=0, min_value=0, max_value=MAX_ROWS)  # islice takes at most sys.maxsize
    limit = serializers.IntegerField(default=20, min_value=1, max_value=200)
