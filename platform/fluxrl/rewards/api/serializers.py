from rest_framework import serializers

from ..models import RewardFunction, RewardVersion


class RewardFunctionSerializer(serializers.ModelSerializer):
    """A team's function, or a built-in (builtin=true, no id, team or versions)."""

    id = serializers.IntegerField(read_only=True, allow_null=True)
    created_at = serializers.DateTimeField(read_only=True, allow_null=True)
    team = serializers.SlugRelatedField(slug_field="slug", read_only=True, allow_null=True)
    builtin = serializers.BooleanField(read_only=True)
    latest_version = serializers.IntegerField(read_only=True, allow_null=True)
    ref = serializers.SerializerMethodField(help_text="use as reward.function in a run spec")

    class Meta:
        model = RewardFunction
        fields = ["id", "team", "name", "builtin", "description", "latest_version", "ref", "created_at"]
        read_only_fields = fields

    def get_ref(self, item) -> str:
        get = item.get if isinstance(item, dict) else lambda key: getattr(item, key)
        return get("name") if get("builtin") else f"{get('name')}@{get('latest_version')}"


class RewardVersionSerializer(serializers.ModelSerializer):
    name = serializers.CharField(source="function.name", read_only=True)
    ref = serializers.CharField(source="__str__", read_only=True)
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = RewardVersion
        fields = ["function", "name", "version", "ref", "code", "created_by", "created_at"]
        read_only_fields = fields


class RewardCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=100)
    team = serializers.SlugField(required=False)
    description = serializers.CharField(default="", allow_blank=True)
    code = serializers.CharField(trim_whitespace=False, help_text="defines reward(prompt, completion, **fields) -> float")


class RewardVersionCreateSerializer(serializers.Serializer):
    code = serializers.CharField(trim_whitespace=False)


class TryRowSerializer(serializers.Serializer):
    prompt = serializers.CharField(allow_blank=True, trim_whitespace=False)
    completion = serializers.CharField(allow_blank=True, trim_whitespace=False)
    fields = serializers.DictField(default=dict, help_text="the dataset row's other fields, e.g. answer")


class RewardTrySerializer(serializers.Serializer):
    """Rows to score: given directly, or the first n rows of a dataset version (completion =
    the row's answer unless completions are given)."""

    rows = TryRowSerializer(many=True, required=False)
    dataset = serializers.CharField(required=False, help_text="name@version of a team dataset")
    n = serializers.IntegerField(default=5, min_value=1, max_value=2**31 - 1)  # read with islice: at most sys.maxsize
    completions = serializers.ListField(child=serializers.CharField(allow_blank=True, trim_whitespace=False), required=False)
    team = serializers.SlugField(required=False, help_text="team of the dataset (and function)")
    timeout_s = serializers.FloatField(required=False, min_value=0.1,
                                       help_text="per row; rows x timeout_s <= FLUXRL_TRY_MAX_SECONDS "
                                                 "(default: min(2, that bound / rows))")
    memory_mb = serializers.IntegerField(default=256, min_value=64, max_value=2048)

    def validate(self, data):
        if ("rows" in data) == ("dataset" in data):
            raise serializers.ValidationError("give either rows or dataset")
        return data


class RewardTryVersionSerializer(RewardTrySerializer):
    version = serializers.IntegerField(required=False, help_text="default: the newest")


class RewardTryAnySerializer(RewardTrySerializer):
    function = serializers.CharField(required=False, help_text="a built-in name or name@version of a team function")
    code = serializers.CharField(required=False, trim_whitespace=False, help_text="unsaved code to try")

    def validate(self, data):
        if ("function" in data) == ("code" in data):
            raise serializers.ValidationError("give either function or code")
        return super().validate(data)


class TryResultRowSerializer(serializers.Serializer):
    prompt = serializers.CharField()
    completion = serializers.CharField()
    reward = serializers.FloatField(allow_null=True)
    error = serializers.CharField(allow_null=True)
    ms = serializers.FloatField()


class TryResultSerializer(serializers.Serializer):
    ok = serializers.BooleanField(help_text="every row scored without error")
    error = serializers.CharField(allow_null=True, help_text="the code could not be loaded at all")
    results = TryResultRowSerializer(many=True)
