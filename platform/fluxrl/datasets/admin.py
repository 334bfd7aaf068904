from django.contrib import admin

from .models import Dataset, DatasetVersion


class DatasetVersionInline(admin.TabularInline):
    model = DatasetVersion
    extra = 0
    can_delete = False
    fields = readonly_fields = ["version", "row_count", "size_bytes", "sha256", "source", "created_at"]

    def has_add_permission(self, request, obj=None):
        return False  # versions are immutable and made by upload or generation only


@admin.register(Dataset)
class DatasetAdmin(admin.ModelAdmin):
    list_display = ["name", "team", "created_at"]
    list_filter = ["team"]
    search_fields = ["name"]
    inlines = [DatasetVersionInline]
