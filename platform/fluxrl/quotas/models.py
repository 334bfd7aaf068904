from django.conf import settings
from django.db import models

from fluxrl.accounts.models import Organisation, Team


class TeamQuota(models.Model):
    """A team's own limits, set by a platform admin in the Django admin. An empty field
    means the deployment's default (FLUXRL_QUOTA_* in settings); 0 allows none."""

    team = models.OneToOneField(Team, on_delete=models.CASCADE, related_name="quota")
    max_runs = models.PositiveIntegerField(
        null=True, blank=True, help_text="live runs at once (queued, starting or running); empty: FLUXRL_QUOTA_RUNS")
    max_engines = models.PositiveIntegerField(
        null=True, blank=True, help_text="rollout engines across the team's live runs; empty: FLUXRL_QUOTA_ENGINES")
    max_nodes = models.PositiveIntegerField(
        null=True, blank=True, help_text="nodes across the team's live runs; empty: FLUXRL_QUOTA_NODES")
    max_storage_bytes = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="bytes of stored dataset versions and uploaded models; "
        "empty: FLUXRL_QUOTA_STORAGE_MB")
    max_files = models.PositiveIntegerField(
        null=True, blank=True, help_text="stored files (one per dataset version, each file of an uploaded model); "
        "empty: FLUXRL_QUOTA_FILES")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self):
        return f"quota of {self.team}"


class UserQuota(models.Model):
    """A person's own limits across every team they are in, set by a platform admin: the
    runs they submitted and the dataset and model versions they uploaded count, whichever
    team holds them. An empty field means the deployment's default (FLUXRL_QUOTA_USER_*)."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="quota")
    max_runs = models.PositiveIntegerField(
        null=True, blank=True, help_text="live runs the person submitted, in all their teams; "
        "empty: FLUXRL_QUOTA_USER_RUNS")
    max_storage_bytes = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="bytes of the dataset and model versions the person uploaded, in all "
        "their teams; empty: FLUXRL_QUOTA_USER_STORAGE_MB")
    max_files = models.PositiveIntegerField(
        null=True, blank=True, help_text="files the person stored, in all their teams; empty: FLUXRL_QUOTA_USER_FILES")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self):
        return f"quota of {self.user}"


class OrganisationQuota(models.Model):
    """An organisation's limits over all its teams together, set by a platform admin. An
    empty field means the deployment's default (FLUXRL_QUOTA_ORG_*; unset: no limit)."""

    organisation = models.OneToOneField(Organisation, on_delete=models.CASCADE, related_name="quota")
    max_runs = models.PositiveIntegerField(
        null=True, blank=True, help_text="live runs of all its teams; empty: FLUXRL_QUOTA_ORG_RUNS")
    max_storage_bytes = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="bytes stored by all its teams; empty: FLUXRL_QUOTA_ORG_STORAGE_MB")
    max_files = models.PositiveIntegerField(
        null=True, blank=True, help_text="files stored by all its teams; empty: FLUXRL_QUOTA_ORG_FILES")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self):
        return f"quota of {self.organisation}"
