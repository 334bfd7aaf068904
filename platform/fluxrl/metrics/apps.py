from django.apps import AppConfig


class MetricsConfig(AppConfig):
    name = "fluxrl.metrics"
    label = "metrics"
