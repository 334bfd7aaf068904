from rest_framework import serializers


class QuotaUseSerializer(serializers.Serializer):
    used = serializers.IntegerField()
    limit = serializers.IntegerField(allow_null=True, help_text="null: no limit")
    source = serializers.CharField(help_text="where the limit comes from: an admin's quota or a deployment default")


class PerRunCeilingsSerializer(serializers.Serializer):
    engines = serializers.IntegerField(allow_null=True, help_text="rollout.engines of one run at most")
    nodes = serializers.IntegerField(allow_null=True, help_text="resources.nodes of one run at most")
    train_tokens = serializers.IntegerField(allow_null=True, help_text="tokens one run's training may generate at "
                                            "most: max_steps x batch_prompts x group_size x max_tokens")
    eval_set_tokens = serializers.IntegerField(allow_null=True, help_text="tokens one evaluation set may generate "
                                               "at one evaluation at most: its prompts x n x max_tokens")
    eval_tokens = serializers.IntegerField(allow_null=True, help_text="tokens all of one run's evaluations may "
                                           "generate at most")


class SharedQuotaSerializer(serializers.Serializer):
    runs = QuotaUseSerializer(help_text="live runs (queued, starting, running)")
    storage_bytes = QuotaUseSerializer(help_text="bytes of dataset versions and uploaded models")
    files = QuotaUseSerializer(help_text="stored files")


class OrganisationQuotaSerializer(SharedQuotaSerializer):
    slug = serializers.SlugField()


class TeamQuotaSerializer(serializers.Serializer):
    team = serializers.CharField()
    runs = QuotaUseSerializer(help_text="live runs (queued, starting, running)")
    engines = QuotaUseSerializer(help_text="rollout engines across live runs")
    nodes = QuotaUseSerializer(help_text="nodes across live runs")
    storage_bytes = QuotaUseSerializer(help_text="bytes of dataset versions and uploaded models")
    files = QuotaUseSerializer(help_text="stored files")
    per_run = PerRunCeilingsSerializer()
    person = SharedQuotaSerializer(allow_null=True, help_text="yours, across all your teams: the runs you submitted "
                                   "and the versions you uploaded")
    organisation = OrganisationQuotaSerializer(allow_null=True, help_text="the team's organisation's, over all its "
                                               "teams; null when the team belongs to none")
