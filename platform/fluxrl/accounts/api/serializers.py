from rest_framework import serializers

from ..models import ApiToken, Membership, Role, Scope, Team


class TeamSerializer(serializers.ModelSerializer):
    role = serializers.ChoiceField(choices=Role.choices, read_only=True, help_text="your role in the team")

    class Meta:
        model = Team
        fields = ["slug", "name", "role", "created_at"]


class TeamCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=100)
    slug = serializers.SlugField(max_length=50)


class MemberSerializer(serializers.ModelSerializer):
    username = serializers.CharField(source="user.username")

    class Meta:
        model = Membership
        fields = ["username", "role", "created_at"]


class MemberCreateSerializer(serializers.Serializer):
    username = serializers.CharField(max_length=150)
    role = serializers.ChoiceField(choices=Role.choices, default=Role.MEMBER)


class SandboxStateSerializer(serializers.Serializer):
    available = serializers.BooleanField(help_text="reward code can be contained on this server: a real sandbox "
                                         "was started to prove it")
    reason = serializers.CharField(help_text="what the probe found: what is missing and how to fix it, when not available")


class MeSerializer(serializers.Serializer):
    username = serializers.CharField()
    teams = TeamSerializer(many=True)
    sandbox = SandboxStateSerializer(help_text="whether this server can run reward code (reward functions, try it)")


class ApiTokenSerializer(serializers.ModelSerializer):
    team = serializers.SlugRelatedField(slug_field="slug", read_only=True, allow_null=True)
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=Scope.choices))
    active = serializers.BooleanField(source="is_active", read_only=True)

    class Meta:
        model = ApiToken
        fields = ["id", "name", "prefix", "scopes", "team", "expires_at", "last_used_at", "created_at", "revoked_at", "active"]
        read_only_fields = fields


class ApiTokenCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=100)
    scopes = serializers.MultipleChoiceField(choices=Scope.choices, default=[Scope.READ, Scope.WRITE])
    team = serializers.SlugField(required=False, help_text="bind the token to one of your teams")
    expires_at = serializers.DateTimeField(required=False)


class ApiTokenCreatedSerializer(ApiTokenSerializer):
    key = serializers.CharField(read_only=True, help_text="shown once; only its hash is stored")

    class Meta(ApiTokenSerializer.Meta):
        fields = [*ApiTokenSerializer.Meta.fields, "key"]


class ReportDefaultsSerializer(serializers.Serializer):
    team = serializers.SlugField(read_only=True, help_text="the team's slug")
    report = serializers.JSONField(help_text="the team's default metric exporters: a run spec's `report` section "
                                   "({tensorboard: {dir}, mlflow: {tracking_uri, experiment, run_name, tags}, "
                                   "wandb: {project, entity, mode, dir, name, group, tags}}), merged under each "
                                   "run's own report when it is submitted; {} for none")
