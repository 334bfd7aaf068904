from rest_framework import serializers

from ..models import StoredModel, StoredModelVersion


class StoredModelVersionSerializer(serializers.ModelSerializer):
    name = serializers.CharField(source="model.name", read_only=True)
    ref = serializers.SerializerMethodField(help_text="use as model.path (a causal LM) or reward.model.path "
                                                      "(a classifier) in a run spec")
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = StoredModelVersion
        fields = ["model", "name", "version", "ref", "kind", "architecture", "sha256", "size_bytes", "files",
                  "source_name", "created_by", "created_at"]
        read_only_fields = fields

    def get_ref(self, version) -> str:
        return f"model:{version.model.name}@{version.version}"


class StoredModelSerializer(serializers.ModelSerializer):
    team = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    latest = serializers.SerializerMethodField()
    version_count = serializers.IntegerField(read_only=True)

    class Meta:
        model = StoredModel
        fields = ["id", "team", "name", "description", "created_at", "version_count", "latest"]
        read_only_fields = fields

    def get_latest(self, model) -> StoredModelVersionSerializer:
        latest = max(model.versions.all(), key=lambda v: v.version, default=None)  # prefetched
        return StoredModelVersionSerializer(latest).data if latest else None


class StoredModelUploadSerializer(serializers.Serializer):
    file = serializers.FileField(help_text="a Hugging Face model folder as .tar, .tar.gz or .zip: safetensors weights, "
                                           "config.json and tokenizer files")
    name = serializers.CharField(max_length=100, help_text="a new name creates a model; an existing one a new version")
    team = serializers.SlugField(required=False, help_text="team slug; optional if you have one team")
    description = serializers.CharField(default="", allow_blank=True)
