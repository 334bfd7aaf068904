from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "fluxrl.dashboard"
    label = "dashboard"
