from django.apps import AppConfig


class RewardsConfig(AppConfig):
    name = "fluxrl.rewards"
    label = "rewards"
