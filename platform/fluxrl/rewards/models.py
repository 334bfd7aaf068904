from django.conf import settings
from django.db import models

from fluxrl.accounts.models import Team


class RewardFunction(models.Model):
    """A team's reward function written in Python: `def reward(prompt, completion, **fields) -> float`."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="reward_functions")
    name = models.CharField(max_length=100)
    description = models.TextField(blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "name"], name="unique_reward_name")]

    def __str__(self):
        return f"{self.team}/{self.name}"


class RewardVersion(models.Model):
    """Immutable code of one version; runs pin the version they were submitted with."""

    function = models.ForeignKey(RewardFunction, on_delete=models.CASCADE, related_name="versions")
    version = models.PositiveIntegerField()
    code = models.TextField()
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["function", "version"], name="unique_reward_version")]
        ordering = ["function", "-version"]

    def __str__(self):
        return f"{self.function.name}@{self.version}"
