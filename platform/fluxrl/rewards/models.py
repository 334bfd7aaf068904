from django.db import models

from fluxrl.versioned import ImmutableVersion, NamedTeamObject


class RewardFunction(NamedTeamObject):
    """A team's reward function written in Python: `def reward(prompt, completion, **fields) -> float`."""


class RewardVersion(ImmutableVersion):
    """The code of one version; runs pin the version they were submitted with."""

    function = models.ForeignKey(RewardFunction, on_delete=models.CASCADE, related_name="versions")
    code = models.TextField()

    class Meta(ImmutableVersion.Meta):
        constraints = [models.UniqueConstraint(fields=["function", "version"], name="unique_reward_version")]

    def __str__(self):
        return f"{self.function.name}@{self.version}"
