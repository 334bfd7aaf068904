import json
import math
import time

import pytest

from fluxrl.errors import InvalidInput
from fluxrl.metrics.models import MetricPoint
from fluxrl.metrics.services import downsample, ingest_points, live_columns, read_series


def points(key="reward/mean", steps=range(3), value=lambda s: s / 10):
    return [{"key": key, "step": s, "value": value(s), "time": 1763769600.0 + s} for s in steps]


def test_worker_ingests_a_batch_and_reads_it_back(run_a, worker_client, api_a):
    batch = points() + points("loss/policy", [0, 1])
    response = worker_client(run_a).post(f"/api/runs/{run_a.id}/metrics/", {"points": batch})
    assert response.status_code == 201 and response.json() == {"received": 5}
    series = api_a.get(f"/api/runs/{run_a.id}/metrics/").json()["series"]
    assert series["reward/mean"] == {"step": [0, 1, 2], "value": [0.0, 0.1, 0.2],
                                     "time": [1763769600.0, 1763769601.0, 1763769602.0], "count": 3, "downsampled": False}
    assert set(series) == {"reward/mean", "loss/policy"}


def test_the_same_batch_twice_is_stored_once(run_a, worker_client):
    worker = worker_client(run_a)
    for _ in range(2):
        assert worker.post(f"/api/runs/{run_a.id}/metrics/", {"points": points()}).status_code == 201
    assert MetricPoint.objects.filter(run=run_a).count() == 3


def test_the_last_value_sent_for_a_key_and_step_wins(run_a):
    # A step a resumed engine computes again replaces what its first attempt sent.
    ingest_points(run_a, points(steps=[5], value=lambda s: 1.0))
    ingest_points(run_a, points(steps=[5], value=lambda s: 2.0) + points(steps=[5], value=lambda s: 3.0))
    assert MetricPoint.objects.get(run=run_a).value == 3.0


def test_a_batch_overlapping_stored_points_updates_them_and_adds_the_new_ones(run_a, worker_client):
    # On PostgreSQL the COPY of such a batch fails on the unique index and the
    # ON CONFLICT DO UPDATE insert takes over: stored points take the new values.
    worker = worker_client(run_a)
    worker.post(f"/api/runs/{run_a.id}/metrics/", {"points": points(steps=range(3))})
    retry = points(steps=range(1, 5), value=lambda s: 100 + s)
    assert worker.post(f"/api/runs/{run_a.id}/metrics/", {"points": retry}).json() == {"received": 4}
    stored = dict(MetricPoint.objects.filter(run=run_a).values_list("step", "value"))
    assert stored == {0: 0.0, 1: 101.0, 2: 102.0, 3: 103.0, 4: 104.0}
    assert MetricPoint.objects.filter(run=run_a).count() == 5


@pytest.mark.django_db(transaction=True)
def test_an_overlapping_batch_outside_a_transaction_updates_and_adds_points(run_a):
    # As in the web server (autocommit): the failed COPY is a transaction of its own.
    ingest_points(run_a, points(steps=range(3)))
    assert ingest_points(run_a, points(steps=range(1, 5), value=lambda s: 100 + s)) == 4
    stored = dict(MetricPoint.objects.filter(run=run_a).values_list("step", "value"))
    assert stored == {0: 0.0, 1: 101.0, 2: 102.0, 3: 103.0, 4: 104.0}


def test_a_key_and_step_repeated_in_a_batch_is_stored_once_with_its_last_value(run_a):
    batch = points(steps=[1, 2]) + points(steps=[1], value=lambda s: 9.0)
    assert ingest_points(run_a, batch) == 2
    assert dict(MetricPoint.objects.filter(run=run_a).values_list("step", "value")) == {1: 9.0, 2: 0.2}


def test_integer_values_and_missing_times_are_stored_as_floats_and_now(run_a):
    before = time.time()
    ingest_points(run_a, [{"key": "queue/depth", "step": 0, "value": 3}, {"key": "queue/depth", "step": 1, "value": 2.5, "time": None}])
    rows = list(MetricPoint.objects.filter(run=run_a).order_by("step").values_list("value", "time"))
    assert [v for v, _ in rows] == [3.0, 2.5] and all(before <= t <= time.time() for _, t in rows)


@pytest.mark.parametrize("bad, field", [
    ({"key": ["a"], "step": 1, "value": 1}, "points.1.key"),
    ({"key": "k", "step": True, "value": 1}, "points.1.step"),
    ({"key": "k", "step": 1, "value": 10**400}, "points.1.value"),
    ({"key": "k", "step": 1, "value": math.nan}, "points.1.value"),
    ({"key": "k", "step": 1, "value": 1, "time": math.inf}, "points.1.time"),
    ({"step": 1, "value": 1}, "points.1.key"),
])
def test_bulk_checks_reject_what_the_point_by_point_checks_name(run_a, bad, field):
    with pytest.raises(InvalidInput) as error:
        ingest_points(run_a, points(steps=[0]) + [bad] + points(steps=[2]))
    assert list(error.value.fields) == [field]
    assert not MetricPoint.objects.exists()


def test_a_huge_batch_is_pushed_live_downsampled_per_key(run_a, settings):
    settings.FLUXRL_LIVE_MAX_POINTS = 20
    keys, steps, values, times = live_columns(*zip(*[(k, s, float(s % 7), 0.0) for s in range(500) for k in ("a", "b")]),
                                              limit=settings.FLUXRL_LIVE_MAX_POINTS)
    assert len(keys) <= 20 and set(keys) == {"a", "b"}
    for key in ("a", "b"):
        kept = [s for k, s in zip(keys, steps) if k == key]
        assert kept[0] == 0 and kept[-1] == 499 and kept == sorted(kept)
    assert live_columns(["a"], [1], [2.0], [3.0], limit=1) == (["a"], [1], [2.0], [3.0])


def test_more_than_1000_points_is_413(run_a, worker_client, assert_error):
    response = worker_client(run_a).post(f"/api/runs/{run_a.id}/metrics/", {"points": points(steps=range(1001))})
    assert_error(response, 413, "too_large")
    assert not MetricPoint.objects.exists()


def test_body_over_1_mb_is_413(run_a, worker_client, assert_error):
    batch = points(key="k", steps=range(10)) + [{"key": "k", "step": 99, "value": 1, "pad": "x" * (1024 * 1024)}]
    response = worker_client(run_a).post(f"/api/runs/{run_a.id}/metrics/", json.dumps({"points": batch}),
                                         content_type="application/json")
    assert_error(response, 413, "too_large")


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"key": "a b", "step": 1, "value": 1}, "points.1.key"),
        ({"key": "k", "step": -1, "value": 1}, "points.1.step"),
        ({"key": "k", "step": 1.5, "value": 1}, "points.1.step"),
        ({"key": "k", "step": 2**63, "value": 1}, "points.1.step"),
        ({"key": "k", "step": 1, "value": "high"}, "points.1.value"),
        ({"key": "k", "step": 1, "value": True}, "points.1.value"),
        ({"key": "k", "step": 1, "value": 1, "time": "now"}, "points.1.time"),
        ("just text", "points.1"),
    ],
)
def test_invalid_points_reject_the_batch_naming_the_point(run_a, worker_client, assert_error, bad, field):
    batch = points(steps=[0]) + [bad]
    assert_error(worker_client(run_a).post(f"/api/runs/{run_a.id}/metrics/", {"points": batch}), 400, field=field)
    assert not MetricPoint.objects.exists()


def test_missing_points_list_is_400(run_a, worker_client, assert_error):
    assert_error(worker_client(run_a).post(f"/api/runs/{run_a.id}/metrics/", {"pts": []}), 400, field="points")


def test_read_filters_keys_and_since_step(run_a, api_a):
    ingest_points(run_a, points(steps=range(10)) + points("loss/kl", range(10)))
    body = api_a.get(f"/api/runs/{run_a.id}/metrics/", {"keys": "reward/mean,nope", "since_step": 6}).json()
    assert body["run"] == run_a.id
    assert list(body["series"]) == ["reward/mean"] and body["series"]["reward/mean"]["step"] == [7, 8, 9]


def test_read_downsamples_to_max_points_keeping_last_and_extremes(run_a, api_a):
    spike = {500: 100.0, 1200: -50.0}
    ingest_points(run_a, points(steps=range(1000), value=lambda s: spike.get(s, math.sin(s / 50))))
    ingest_points(run_a, points(steps=range(1000, 2000), value=lambda s: spike.get(s, math.sin(s / 50))))
    series = api_a.get(f"/api/runs/{run_a.id}/metrics/", {"max_points": 50}).json()["series"]["reward/mean"]
    assert len(series["step"]) <= 50 and series["downsampled"] and series["count"] == 2000
    assert series["step"][0] == 0 and series["step"][-1] == 1999
    assert max(series["value"]) == 100.0 and min(series["value"]) == -50.0
    assert series["step"] == sorted(series["step"])


@pytest.mark.parametrize("n, max_points", [(10, 10), (11, 10), (1000, 7), (1000, 3), (1000, 2), (1000, 1), (5, 4)])
def test_downsample_never_exceeds_max_points_and_keeps_the_last_point(n, max_points):
    series = [(s, float((s * 7919) % 101), 0.0) for s in range(n)]
    kept = downsample(series, max_points)
    assert len(kept) <= max_points and kept[-1] == series[-1]
    assert kept == series if n <= max_points else len(kept) < n


def test_read_rejects_out_of_range_max_points(run_a, api_a, settings, assert_error):
    assert_error(api_a.get(f"/api/runs/{run_a.id}/metrics/", {"max_points": 0}), 400, field="max_points")
    settings.FLUXRL_METRICS_MAX_POINTS = 100
    with pytest.raises(Exception, match="max_points"):
        read_series(run_a, max_points=101)


def test_other_teams_cannot_read_or_write_metrics(run_a, api_b, assert_error):
    assert_error(api_b.get(f"/api/runs/{run_a.id}/metrics/"), 404)
    assert_error(api_b.post(f"/api/runs/{run_a.id}/metrics/", {"points": points()}), 404)
    assert not MetricPoint.objects.exists()


@pytest.mark.parametrize("n, max_points", [(2000, 50), (2000, 51), (999, 1000), (1000, 7)])
def test_downsample_streams_a_counted_iterator_like_a_list(n, max_points):
    series = [(s, float((s * 7919) % 101), 0.0) for s in range(n)]
    assert downsample(iter(series), max_points, total=n) == downsample(series, max_points)


def test_last_steps_of_each_series(run_a):
    from fluxrl.metrics.services import last_steps

    assert last_steps(run_a) == {}
    ingest_points(run_a, points(steps=range(5)) + points("eval/accuracy", [0, 3]))
    assert last_steps(run_a) == {"reward/mean": 4, "eval/accuracy": 3}


@pytest.mark.parametrize("charset", ["utf-8", "utf-16"])
def test_a_nul_character_anywhere_in_a_batch_is_400(run_a, worker_client, assert_error, charset):
    body = json.dumps({"points": points() + [{"key": "k", "step": 9, "value": 1, "note": "a\x00b"}]})
    response = worker_client(run_a).post(f"/api/runs/{run_a.id}/metrics/", body.encode(charset),
                                         content_type=f"application/json; charset={charset}")
    assert_error(response, 400)
    assert "NUL" in response.json()["error"]["message"]


def test_deleting_a_run_deletes_its_points(run_a, run_b):
    # The points table has no database foreign key (ingest speed): Django's cascade does it.
    ingest_points(run_a, points())
    ingest_points(run_b, points())
    run_a.delete()
    assert list(MetricPoint.objects.values_list("run_id", flat=True).distinct()) == [run_b.pk]
