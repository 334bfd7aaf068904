from django.apps import AppConfig


class EnvironmentsConfig(AppConfig):
    name = "fluxrl.environments"
    label = "environments"
