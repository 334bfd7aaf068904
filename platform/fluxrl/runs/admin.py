from django.contrib import admin

from .models import Checkpoint, Run, RunTag


class RunTagInline(admin.TabularInline):
    model = RunTag
    extra = 0


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ["id", "name", "team", "owner", "status", "created_at", "finished_at"]
    list_filter = ["status", "team"]
    search_fields = ["name", "notes"]
    readonly_fields = ["spec", "resolved_spec", "dataset_version", "reward_version", "created_at", "started_at",
                       "finished_at", "heartbeat_at"]
    inlines = [RunTagInline]


@admin.register(Checkpoint)
class CheckpointAdmin(admin.ModelAdmin):
    list_display = ["run", "step", "version", "path", "created_at"]
