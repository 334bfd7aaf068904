from django.contrib import admin

from .models import MetricPoint


@admin.register(MetricPoint)
class MetricPointAdmin(admin.ModelAdmin):
    list_display = ["run", "key", "step", "value", "time"]
    list_filter = ["key"]
