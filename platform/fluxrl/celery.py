"""The Celery app `fluxrl`. Broker: Redis when REDIS_URL is set, else kombu's
filesystem transport under FLUXRL_DATA_DIR/broker (see settings, CELERY_*).

Workers: `celery -A fluxrl worker -Q cpu` and `celery -A fluxrl worker -Q gpu`."""
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fluxrl.settings")

app = Celery("fluxrl")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
