from django.db import models

from fluxrl.accounts.models import Team


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
