from django.apps import AppConfig


class ModelStoreConfig(AppConfig):
    name = "fluxrl.modelstore"
    label = "modelstore"
    verbose_name = "model folders"
