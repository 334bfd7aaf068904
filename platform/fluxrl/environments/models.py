from django.db import models

from fluxrl.versioned import ImmutableVersion, NamedTeamObject


class TeamEnvironment(NamedTeamObject):
    """A team's agentic environment written in Python: ``class Environment`` with
    ``reset(self, row)`` and ``step(self, text, token_ids)`` (docs/guides/agentic.md). Runs
    name it in ``task.environment.name`` as name@version; its code runs only in the OS
    sandbox of the run's engine, never in the web process."""

    class Meta(NamedTeamObject.Meta):
        verbose_name = "environment"


class EnvironmentVersion(ImmutableVersion):
    """The code of one version; runs pin the version they were submitted with."""

    environment = models.ForeignKey(TeamEnvironment, on_delete=models.CASCADE, related_name="versions")
    code = models.TextField()

    class Meta(ImmutableVersion.Meta):
        verbose_name = "environment version"
        constraints = [models.UniqueConstraint(fields=["environment", "version"], name="unique_environment_version")]

    def __str__(self):
        return f"{self.environment.name}@{self.version}"
