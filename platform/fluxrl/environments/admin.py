from django.contrib import admin

from .models import EnvironmentVersion, TeamEnvironment


class EnvironmentVersionInline(admin.StackedInline):
    model = EnvironmentVersion
    extra = 0
    can_delete = False
    fields = readonly_fields = ["version", "code", "created_by", "created_at"]

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(TeamEnvironment)
class TeamEnvironmentAdmin(admin.ModelAdmin):
    list_display = ["name", "team", "created_at"]
    list_filter = ["team"]
    inlines = [EnvironmentVersionInline]
