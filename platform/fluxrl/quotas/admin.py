from django.contrib import admin

from .models import TeamQuota


@admin.register(TeamQuota)
class TeamQuotaAdmin(admin.ModelAdmin):
    list_display = ["team", "max_runs", "max_engines", "max_nodes", "max_storage_bytes", "max_files", "updated_at"]
    search_fields = ["team__slug", "team__name"]
    raw_id_fields = ["team"]
