from django.contrib import admin

from .models import StoredModel, StoredModelVersion


class StoredModelVersionInline(admin.TabularInline):
    model = StoredModelVersion
    extra = 0
    can_delete = False
    fields = readonly_fields = ["version", "kind", "architecture", "size_bytes", "sha256", "created_at"]

    def has_add_permission(self, request, obj=None):
        return False  # versions are immutable and made by upload only


@admin.register(StoredModel)
class StoredModelAdmin(admin.ModelAdmin):
    list_display = ["name", "team", "created_at"]
    list_filter = ["team"]
    search_fields = ["name"]
    inlines = [StoredModelVersionInline]
