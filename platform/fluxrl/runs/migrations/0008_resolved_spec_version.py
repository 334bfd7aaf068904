"""Stored engine-ready specs state their schema version: an engine refuses a resolved spec of
another version. A stored spec that validates as version 1 is a version 1 spec and is stamped
so; one that does not stays as it is, and the engine refuses it with the reason (submit again)."""
from django.db import migrations


def stamp_version_1(apps, schema_editor):
    from workers.spec import SpecError, validate_spec

    Run = apps.get_model("runs", "Run")
    for run in Run.objects.only("pk", "resolved_spec").iterator():
        stored = run.resolved_spec
        if not isinstance(stored, dict) or "version" in stored:
            continue
        try:  # stored as validated now: the defaults of fields added since are filled in
            run.resolved_spec = validate_spec({**stored, "version": 1}).to_dict()
        except (SpecError, ValueError):
            continue
        run.save(update_fields=["resolved_spec"])


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0007_run_environment_version_sample_episode'),
    ]

    operations = [
        migrations.RunPython(stamp_version_1, migrations.RunPython.noop),
    ]
