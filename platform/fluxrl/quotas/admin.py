from django.contrib import admin

from .models import OrganisationQuota, TeamQuota, UserQuota


@admin.register(TeamQuota)
class TeamQuotaAdmin(admin.ModelAdmin):
    list_display = ["team", "max_runs", "max_engines", "max_nodes", "max_storage_bytes", "max_files", "updated_at"]
    search_fields = ["team__slug", "team__name"]
    raw_id_fields = ["team"]


@admin.register(UserQuota)
class UserQuotaAdmin(admin.ModelAdmin):
    list_display = ["user", "max_runs", "max_storage_bytes", "max_files", "updated_at"]
    search_fields = ["user__username"]
    raw_id_fields = ["user"]


@admin.register(OrganisationQuota)
class OrganisationQuotaAdmin(admin.ModelAdmin):
    list_display = ["organisation", "max_runs", "max_storage_bytes", "max_files", "updated_at"]
    search_fields = ["organisation__slug", "organisation__name"]
    raw_id_fields = ["organisation"]
