from pathlib import Path

from django.conf import settings
from django.db import models

from fluxrl.versioned import ImmutableVersion, NamedTeamObject


class StoredModel(NamedTeamObject):
    """A named Hugging Face model folder of a team (a policy to start from, or a reward
    model); its content lives in immutable StoredModelVersions."""


class StoredModelVersion(ImmutableVersion):
    """One uploaded folder: safetensors weights, config and tokenizer files only, written
    once under FLUXRL_DATA_DIR/team-models/ (outside every model root, so no other team
    can name it by path) and never changed. ``sha256`` is of its manifest (each file's name,
    size and SHA-256), so two uploads of the same files have the same checksum."""

    class Kind(models.TextChoices):
        CAUSAL_LM = "causal-lm"  # model.path: a policy
        SEQUENCE_CLASSIFICATION = "sequence-classification"  # reward.model.path: a reward model

    model = models.ForeignKey(StoredModel, on_delete=models.CASCADE, related_name="versions")
    folder = models.CharField(max_length=300, help_text="path relative to FLUXRL_DATA_DIR")
    sha256 = models.CharField(max_length=64)
    size_bytes = models.BigIntegerField()
    files = models.JSONField(default=list, help_text="[name, bytes, sha256] per file")
    architecture = models.CharField(max_length=200)
    kind = models.CharField(max_length=30, choices=Kind.choices)
    source_name = models.CharField(max_length=200, blank=True, help_text="uploaded archive's name, sanitized")

    class Meta(ImmutableVersion.Meta):
        constraints = [models.UniqueConstraint(fields=["model", "version"], name="unique_stored_model_version")]

    def __str__(self):
        return f"{self.model.name}@{self.version}"

    @property
    def path(self) -> Path:
        return Path(settings.FLUXRL_DATA_DIR) / self.folder
