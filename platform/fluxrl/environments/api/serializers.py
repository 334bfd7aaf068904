from rest_framework import serializers

from ..models import EnvironmentVersion, TeamEnvironment


class EnvironmentSerializer(serializers.ModelSerializer):
    team = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    latest_version = serializers.IntegerField(read_only=True, allow_null=True)
    ref = serializers.SerializerMethodField(help_text="use as task.environment.name in a run spec")

    class Meta:
        model = TeamEnvironment
        fields = ["id", "team", "name", "description", "latest_version", "ref", "created_at"]
        read_only_fields = fields

    def get_ref(self, environment) -> str:
        return f"{environment.name}@{environment.latest_version}"


class EnvironmentVersionSerializer(serializers.ModelSerializer):
    name = serializers.CharField(source="environment.name", read_only=True)
    ref = serializers.CharField(source="__str__", read_only=True)
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = EnvironmentVersion
        fields = ["environment", "name", "version", "ref", "code", "created_by", "created_at"]
        read_only_fields = fields


CODE_HELP = ("Python defining class Environment with reset(self, row) and step(self, text, token_ids); "
             "at most FLUXRL_ENVIRONMENT_CODE_MAX_BYTES bytes; run only in the OS sandbox of a run's engine")


class EnvironmentCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=100)
    team = serializers.SlugField(required=False)
    description = serializers.CharField(default="", allow_blank=True)
    code = serializers.CharField(trim_whitespace=False, help_text=CODE_HELP)


class EnvironmentVersionCreateSerializer(serializers.Serializer):
    code = serializers.CharField(trim_whitespace=False, help_text=CODE_HELP)


class EnvironmentTrySerializer(serializers.Serializer):
    """One episode in the sandbox: reset with ``row``, then a step per turn of ``turns`` (as
    if the policy had generated that text; token_ids are empty here)."""

    row = serializers.DictField(default=dict, help_text="the dataset row reset gets (prompt, answer, ...)")
    turns = serializers.ListField(child=serializers.CharField(allow_blank=True, trim_whitespace=False),
                                  min_length=1, max_length=8, help_text="the policy's turns, in order")
    params = serializers.DictField(default=dict, help_text="keyword arguments for Environment(...)")
    timeout_s = serializers.FloatField(default=2.0, min_value=0.1, help_text="per call; turns x timeout_s <= "
                                                                             "FLUXRL_TRY_MAX_SECONDS")
    memory_mb = serializers.IntegerField(default=256, min_value=64, max_value=2048)
    output_chars = serializers.IntegerField(default=4000, min_value=1, max_value=100_000)


class EnvironmentTryVersionSerializer(EnvironmentTrySerializer):
    version = serializers.IntegerField(required=False, help_text="default: the newest")


class EnvironmentTryAnySerializer(EnvironmentTrySerializer):
    environment = serializers.CharField(required=False, help_text="name@version of a team environment")
    team = serializers.SlugField(required=False, help_text="team of the environment")
    code = serializers.CharField(required=False, trim_whitespace=False, help_text="unsaved code to try")

    def validate(self, data):
        if ("environment" in data) == ("code" in data):
            raise serializers.ValidationError("give either environment or code")
        return data


class TryObservationSerializer(serializers.Serializer):
    role = serializers.CharField()
    content = serializers.CharField()


class TryStepSerializer(serializers.Serializer):
    text = serializers.CharField()
    observation = TryObservationSerializer(allow_null=True)
    reward = serializers.FloatField()
    done = serializers.BooleanField()
    error = serializers.CharField(allow_null=True, help_text="the call failed (raised, timed out, flooded, forked)")
    ms = serializers.FloatField()


class EnvironmentTryResultSerializer(serializers.Serializer):
    ok = serializers.BooleanField(help_text="every step answered without error")
    error = serializers.CharField(allow_null=True)
    steps = TryStepSerializer(many=True)
