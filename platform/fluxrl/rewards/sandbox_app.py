"""The Celery app of the `sandbox` service (docker-compose.yml): it knows the try-it tasks
(reward functions, environments) and nothing else, so a message for another task (a run,
the reaper) sent to its queue is rejected, never executed, and it needs no database and no Django secret.

    celery -A fluxrl.rewards.sandbox_app worker -Q sandbox --concurrency 2
"""
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fluxrl.settings")

app = Celery("fluxrl", include=["fluxrl.rewards.tasks", "fluxrl.environments.tasks"])  # no autodiscover: only these
app.config_from_object("django.conf:settings", namespace="CELERY")
