from django.apps import AppConfig


class QuotasConfig(AppConfig):
    name = "fluxrl.quotas"
    label = "quotas"
    verbose_name = "Team quotas"
