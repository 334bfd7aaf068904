from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "fluxrl.accounts"
    label = "accounts"
