"""A run's cluster key comes from FLUXRL_CLUSTER_KEY_SECRET (the workers' secret), not from
the Django secret, and neither secret nor the Redis password reaches the engine."""
import json
import sys
from pathlib import Path

import pytest

from fluxrl.runs import dispatch

pytestmark = pytest.mark.django_db(transaction=True)

FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")


def test_the_cluster_key_is_derived_from_the_cluster_key_secret_not_the_django_secret(settings, run_a, run_b):
    settings.FLUXRL_CLUSTER_KEY_SECRET, settings.SECRET_KEY = "workers-secret", "django-secret"
    key = dispatch.cluster_key(run_a)
    settings.SECRET_KEY = "another-django-secret"
    assert dispatch.cluster_key(run_a) == key  # whoever holds the Django secret cannot derive it
    settings.FLUXRL_CLUSTER_KEY_SECRET = "another-workers-secret"
    assert dispatch.cluster_key(run_a) != key
    assert dispatch.cluster_key(run_a) != dispatch.cluster_key(run_b)
    assert len(bytes.fromhex(key)) == 32


def test_the_engine_gets_neither_the_cluster_key_secret_nor_the_redis_password(settings, monkeypatch, run_a):
    settings.FLUXRL_ENGINE_COMMAND = [sys.executable, str(FAKE_ENGINE)]
    settings.FLUXRL_PUBLIC_URL = "http://platform.example:8000"
    monkeypatch.setenv("FAKE_ENGINE_MODE", "ok")
    monkeypatch.setenv("FLUXRL_CLUSTER_KEY_SECRET", "workers-secret")
    monkeypatch.setenv("REDIS_URL", "redis://:broker-password@redis:6379/0")
    assert dispatch.execute_run(run_a.pk) == "succeeded"
    env = json.loads((dispatch.run_dir(run_a.pk) / "out" / "call.json").read_text())["env"]
    assert "FLUXRL_CLUSTER_KEY_SECRET" not in env and "REDIS_URL" not in env
