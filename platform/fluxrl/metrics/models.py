from django.db import models


class MetricPoint(models.Model):
    """One value of one metric key at one step of a run (docs/architecture.md §5); a step
    sent again (a retry, or recomputed after a resume) replaces its value."""

    # No database foreign key and no index of its own: a foreign-key check is a lookup and
    # a lock on the run's row per inserted point, which cost more than the insert itself
    # (bench/ingest.py). Points go with their run through Django's cascade; the unique
    # (run, key, step) index below serves every lookup by run.
    run = models.ForeignKey("runs.Run", on_delete=models.CASCADE, related_name="metric_points",
                            db_constraint=False, db_index=False)
    key = models.CharField(max_length=100)
    step = models.BigIntegerField()
    value = models.FloatField()
    time = models.FloatField(help_text="wall clock, unix seconds")

    class Meta:
        # The unique index (run, key, step) makes retried batches idempotent and also
        # serves the range reads: WHERE run = ? AND key IN (...) AND step > ? ORDER BY key, step.
        constraints = [models.UniqueConstraint(fields=["run", "key", "step"], name="unique_metric_point")]

    def __str__(self):
        return f"run {self.run_id} {self.key}@{self.step}={self.value}"
