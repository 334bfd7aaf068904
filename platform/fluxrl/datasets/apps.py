from django.apps import AppConfig


class DatasetsConfig(AppConfig):
    name = "fluxrl.datasets"
    label = "datasets"
