from django.conf import settings
from django.db import models

from fluxrl.accounts.models import Team


class RunStatus(models.TextChoices):
    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


MAX_STEP = 2**63 - 1  # BigIntegerField
MAX_INT = 2**31 - 1  # IntegerField on every database

TERMINAL_STATUSES = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED})


class Run(models.Model):
    """One RL run: the spec as submitted, the engine-ready spec it resolved to (dataset
    and reward versions pinned), and its lifecycle (see services.transition)."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="runs")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="runs")
    name = models.CharField(max_length=200)
    spec = models.JSONField(help_text="the run spec as submitted")
    resolved_spec = models.JSONField(help_text="engine-ready spec at submission (see services.resolve_spec)")
    dataset_version = models.ForeignKey("datasets.DatasetVersion", null=True, blank=True, on_delete=models.PROTECT, related_name="runs")
    reward_version = models.ForeignKey("rewards.RewardVersion", null=True, blank=True, on_delete=models.PROTECT, related_name="runs")
    # task.environment.name: a team environment's name@version, pinned at submission
    environment_version = models.ForeignKey("environments.EnvironmentVersion", null=True, blank=True,
                                            on_delete=models.PROTECT, related_name="runs")
    # model:<name> references of model.path and reward.model.path, pinned at submission
    model_version = models.ForeignKey("modelstore.StoredModelVersion", null=True, blank=True, on_delete=models.PROTECT,
                                      related_name="runs_as_policy")
    reward_model_version = models.ForeignKey("modelstore.StoredModelVersion", null=True, blank=True,
                                             on_delete=models.PROTECT, related_name="runs_as_reward_model")
    notes = models.TextField(blank=True)
    status = models.CharField(max_length=10, choices=RunStatus.choices, default=RunStatus.QUEUED, db_index=True)
    failure_reason = models.TextField(blank=True)
    cancel_requested = models.BooleanField(default=False, help_text="cooperative: the worker checks it and stops")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)
    worker_host = models.CharField(max_length=255, blank=True)
    worker_pid = models.IntegerField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    # rollout.share_engines: the node's shared engine pools the run is on, as its heartbeat
    # last said ([{"id", "share", "fair_share"}]); who shares them is computed per viewer
    engine_pools = models.JSONField(default=list, blank=True)
    # whether those pools came from the engine the platform itself started (a run token the
    # dispatcher minted): only such claims count on another team's run page
    engine_pools_attested = models.BooleanField(default=False)
    rendezvous = models.CharField(max_length=300, blank=True,
                                  help_text="runs over several nodes: node 0's host:port, where the other nodes' agents join")

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["team", "-created_at"], name="run_team_created")]

    def __str__(self):
        return f"run {self.pk} {self.name} ({self.status})"

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


class RunTag(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="tags")
    name = models.CharField(max_length=50, db_index=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "name"], name="unique_run_tag")]
        ordering = ["name"]


class Sample(models.Model):
    """A stored generated completion. `version_runs` is the policy version of each token,
    run-length encoded: [[version, token_count], ...] (a sequence may span versions).
    `tokens` is each completion token's own text at the tokenizer's real boundaries
    (special tokens shown), one per token as in version_runs; null for samples reported
    without it (the run page then spreads versions over the characters)."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="samples")
    uid = models.CharField(max_length=64, null=True, blank=True, help_text="client id; a retried batch is not stored twice")
    step = models.BigIntegerField()
    prompt = models.TextField()
    completion = models.TextField()
    reward = models.FloatField(null=True, blank=True)
    version_runs = models.JSONField(default=list)
    tokens = models.JSONField(null=True, blank=True, help_text="each completion token's text, or null")
    length = models.IntegerField(help_text="completion tokens")
    error = models.TextField(blank=True)
    # an episode of an agentic run (task.environment): its turns, tool calls and end
    # reason (SampleInSerializer.episode); null for a single-turn sample
    episode = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "uid"], name="unique_sample_uid")]
        indexes = [models.Index(fields=["run", "step"], name="sample_run_step")]
        ordering = ["run", "step", "id"]


class Checkpoint(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="checkpoints")
    step = models.BigIntegerField()
    version = models.IntegerField(help_text="policy version saved")
    path = models.CharField(max_length=500)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "step"], name="unique_checkpoint_step")]
        ordering = ["run", "step"]
