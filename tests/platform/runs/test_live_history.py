"""The history a live view gets on connect (live.snapshot) fits daphne's websocket
message limit (1 MiB; past it the socket is closed with 1011) however many metrics a
run has: it is split into several history messages, which together hold every point."""
import json

import pytest

from fluxrl.metrics.models import MetricPoint
from fluxrl.metrics import live

pytestmark = pytest.mark.django_db

DAPHNE_MAX_MESSAGE = 1024 * 1024


def test_a_long_history_arrives_in_messages_under_the_websocket_limit(run_a):
    keys = [f"metric/{i:02d}" for i in range(20)]
    MetricPoint.objects.bulk_create([MetricPoint(run=run_a, key=key, step=step, value=step / 7, time=1763769600.0 + step)
                                     for key in keys for step in range(1000)])
    messages = live.snapshot(run_a, max_points=1000)

    histories = [m for m in messages if m["type"] == "metrics"]
    assert len(histories) > 1 and all(m["history"] for m in histories)
    assert max(len(json.dumps(m)) for m in messages) < DAPHNE_MAX_MESSAGE
    points = [(p["key"], p["step"]) for m in histories for p in m["points"]]
    assert len(points) == len(set(points)) == 20 * 1000
    assert [p[1] for p in points] == sorted(p[1] for p in points)  # still in step order across messages
    assert [m["type"] for m in (messages[0], messages[-1])] == ["status", "samples"]


def test_an_empty_history_is_still_one_message(run_a):
    assert [m["type"] for m in live.snapshot(run_a)] == ["status", "metrics", "samples"]
