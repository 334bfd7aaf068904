from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone


class Organisation(models.Model):
    """A tenant above teams, created by the operator in the Django admin: its teams share
    its quotas (quotas.OrganisationQuota) and one weight on shared engine pools, so making
    another team in it adds neither. Which team belongs to it is the operator's too."""

    name = models.CharField(max_length=100)
    slug = models.SlugField(max_length=50, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # rollout.share_engines: the weight of all the organisation's runs together on a shared
    # engine pool (quotas.services.pool_tenant), whatever the number of its teams
    engine_share = models.FloatField(default=1.0, validators=[MinValueValidator(0.01), MaxValueValidator(1000.0)],
                                     help_text="weight of this organisation's runs on shared engine pools "
                                     "(1 = an equal share), for all its teams together")

    def __str__(self):
        return self.slug


class Team(models.Model):
    name = models.CharField(max_length=100)
    slug = models.SlugField(max_length=50, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # The operator's (Django admin), never the API's: a team's members could otherwise move
    # it out of the organisation whose quotas hold it. PROTECT: deleting an organisation
    # would free its teams of its limits.
    organisation = models.ForeignKey(Organisation, null=True, blank=True, on_delete=models.PROTECT,
                                     related_name="teams")
    # The team's default metric exporters: a run spec's `report` section (workers/spec/report.py
    # ReportSpec), merged under each run's own when it is submitted (runs.services.submit_run).
    report_defaults = models.JSONField(default=dict, blank=True)
    # rollout.share_engines (workers/rollout/pool.py): the team's weight in the fair share of
    # a shared engine pool, split among its runs there. The operator's (admin), not a spec's.
    engine_share = models.FloatField(default=1.0, validators=[MinValueValidator(0.01), MaxValueValidator(1000.0)],
                                     help_text="weight of this team's runs on shared engine pools (1 = an equal share)")

    def __str__(self):
        return self.slug


class Role(models.TextChoices):
    ADMIN = "admin"
    MEMBER = "member"


class Membership(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "team"], name="unique_membership")]

    def __str__(self):
        return f"{self.user} in {self.team} ({self.role})"


class Scope(models.TextChoices):
    READ = "read"
    WRITE = "write"


class TokenBase(models.Model):
    """A bearer key of which only the sha256 is stored; `prefix` identifies it in lists."""

    prefix = models.CharField(max_length=16, db_index=True)
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        abstract = True

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > timezone.now())


class ApiToken(TokenBase):
    """A person's key for the REST API, optionally limited to one team and to read-only."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    scopes = models.JSONField(default=list)
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    last_used_at = models.DateTimeField(null=True, blank=True)

    def __str__(self):
        return f"{self.prefix}… ({self.user}: {self.name})"


class RunToken(TokenBase):
    """A worker's key: may only report to its one run; revoked when the run ends. One a
    person minted (minted_by, and minted_with when through an API token) also ends with
    that person's rights: membership of the run's team, an active user, a live API token.
    The dispatcher's own (minted_by empty) serve the run's engine while the run is live."""

    run = models.ForeignKey("runs.Run", on_delete=models.CASCADE, related_name="tokens")
    minted_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE,
                                  related_name="+")
    minted_with = models.ForeignKey(ApiToken, null=True, blank=True, on_delete=models.CASCADE, related_name="+")

    def __str__(self):
        return f"{self.prefix}… (run {self.run_id})"
