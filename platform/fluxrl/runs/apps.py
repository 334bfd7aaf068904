from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "fluxrl.runs"
    label = "runs"
