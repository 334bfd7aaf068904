from django.contrib import admin

from .models import RewardFunction, RewardVersion


class RewardVersionInline(admin.StackedInline):
    model = RewardVersion
    extra = 0
    can_delete = False
    fields = readonly_fields = ["version", "code", "created_by", "created_at"]

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(RewardFunction)
class RewardFunctionAdmin(admin.ModelAdmin):
    list_display = ["name", "team", "created_at"]
    list_filter = ["team"]
    inlines = [RewardVersionInline]
