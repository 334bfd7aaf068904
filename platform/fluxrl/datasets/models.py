from pathlib import Path

from django.conf import settings
from django.db import models

from fluxrl.versioned import ImmutableVersion, NamedTeamObject


class Dataset(NamedTeamObject):
    """A named dataset of a team; its content lives in immutable DatasetVersions."""


class DatasetVersion(ImmutableVersion):
    """One upload, import or generation: normalized JSONL rows {"prompt", "answer", ...extra},
    written once under FLUXRL_DATA_DIR and never changed; `sha256` is of that file. Whatever
    the source format (JSONL, CSV, Parquet, Arrow, a Hugging Face save_to_disk folder), a run
    reads the same normalized file."""

    class Source(models.TextChoices):
        JSONL = "jsonl"
        CSV = "csv"
        PARQUET = "parquet"
        ARROW = "arrow"
        HF_DATASET = "hf_dataset", "Hugging Face datasets folder"
        GENERATOR = "generator"

    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="versions")
    file = models.CharField(max_length=300, help_text="path relative to FLUXRL_DATA_DIR")
    sha256 = models.CharField(max_length=64)
    size_bytes = models.BigIntegerField()
    row_count = models.PositiveIntegerField()
    columns = models.JSONField(default=list)
    source = models.CharField(max_length=10, choices=Source.choices)
    source_name = models.CharField(max_length=200, blank=True,
                                   help_text="uploaded file name, sanitized, or the imported folder and split")
    source_fields = models.JSONField(default=dict, help_text="source column names of prompt and answer")
    generator = models.JSONField(null=True, blank=True, help_text="{name, n, seed, params} for built-in data")

    class Meta(ImmutableVersion.Meta):
        constraints = [models.UniqueConstraint(fields=["dataset", "version"], name="unique_dataset_version")]

    def __str__(self):
        return f"{self.dataset.name}@{self.version}"

    @property
    def path(self) -> Path:
        return Path(settings.FLUXRL_DATA_DIR) / self.file
