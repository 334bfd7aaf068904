from rest_framework import serializers


class QuotaUseSerializer(serializers.Serializer):
    used = serializers.IntegerField()
    limit = serializers.IntegerField(allow_null=True, help_text="null: no limit")
    source = serializers.CharField(help_text="where the limit comes from: the team's quota or a deployment default")


class PerRunCeilingsSerializer(serializers.Serializer):
    engines = serializers.IntegerField(allow_null=True, help_text="rollout.engines of one run at most")
    nodes = serializers.IntegerField(allow_null=True, help_text="resources.nodes of one run at most")


class TeamQuotaSerializer(serializers.Serializer):
    team = serializers.CharField()
    runs = QuotaUseSerializer(help_text="live runs (queued, starting, running)")
    engines = QuotaUseSerializer(help_text="rollout engines across live runs")
    nodes = QuotaUseSerializer(help_text="nodes across live runs")
    storage_bytes = QuotaUseSerializer(help_text="bytes of dataset versions and uploaded models")
    files = QuotaUseSerializer(help_text="stored files")
    per_run = PerRunCeilingsSerializer()
