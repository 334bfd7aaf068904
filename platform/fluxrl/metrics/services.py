"""Metric points: idempotent batch ingest from workers and downsampled range reads."""
from __future__ import annotations

import math
import re
import time
from itertools import groupby

from django.conf import settings

from fluxrl.errors import TooLarge, field_error
from fluxrl.runs import live
from fluxrl.runs.models import MAX_STEP

from .models import MetricPoint

KEY_PATTERN = re.compile(r"[A-Za-z0-9_./:-]{1,100}")


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def clean_point(index: int, point) -> tuple[str, int, float, float]:
    where = f"points.{index}"
    if not isinstance(point, dict):
        raise field_error(where, "expected an object {key, step, value, time}")
    key, step, value, when = point.get("key"), point.get("step"), point.get("value"), point.get("time")
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        raise field_error(f"{where}.key", "1-100 characters of letters, digits and _ . / : -")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise field_error(f"{where}.step", "a whole number >= 0 (64-bit)")
    if not is_number(value):
        raise field_error(f"{where}.value", "a finite number")
    if when is not None and not is_number(when):
        raise field_error(f"{where}.time", "unix seconds")
    return key, step, float(value), float(when if when is not None else time.time())


def ingest_points(run, points: list) -> list[dict]:
    """Store a batch of points [{key, step, value, time}] for a run and return them
    cleaned. Idempotent: a point whose (run, key, step) is stored already is skipped,
    so a retried batch stores nothing twice. More than FLUXRL_INGEST_MAX_POINTS -> 413."""
    if not isinstance(points, list):
        raise field_error("points", "expected a list")
    if len(points) > settings.FLUXRL_INGEST_MAX_POINTS:
        raise TooLarge(f"{len(points)} points in one batch; the limit is {settings.FLUXRL_INGEST_MAX_POINTS}.")
    cleaned = {}
    for index, point in enumerate(points):
        key, step, value, when = clean_point(index, point)
        cleaned[(key, step)] = {"key": key, "step": step, "value": value, "time": when}
    MetricPoint.objects.bulk_create([MetricPoint(run=run, **p) for p in cleaned.values()], ignore_conflicts=True)
    stored = list(cleaned.values())
    on_points_stored(run, stored)
    return stored


def on_points_stored(run, points: list[dict]) -> None:
    """Called after every ingested batch (retries included, so consumers key points by
    (key, step)): pushes {"type": "metrics", "points": points} to the run's live views."""
    live.publish_points(run, points)


# --- reads ------------------------------------------------------------------------------


def downsample(points: list[tuple], max_points: int) -> list[tuple]:
    """At most max_points of (step, value, time), keeping the first and the last point
    and, in each bucket between, its minimum and maximum, so spikes stay visible."""
    if len(points) <= max_points:
        return points
    if max_points < 4:
        stride = (len(points) - 1) / max(max_points - 1, 1)
        picks = sorted({len(points) - 1, *(round(i * stride) for i in range(max_points - 1))})
        return [points[i] for i in picks]
    middle = points[1:-1]
    bucket = math.ceil(len(middle) / ((max_points - 2) // 2))
    kept = [points[0]]
    for start in range(0, len(middle), bucket):
        chunk = middle[start:start + bucket]
        low, high = min(chunk, key=lambda p: p[1]), max(chunk, key=lambda p: p[1])
        kept.extend(sorted({low, high}, key=lambda p: p[0]))
    kept.append(points[-1])
    return kept


def read_series(run, keys: list[str] | None = None, since_step: int | None = None, max_points: int = 1000) -> dict:
    """{key: {"step": [...], "value": [...], "time": [...], "count": n, "downsampled": bool}}
    for the run's points with step > since_step, each series cut to max_points."""
    if not 1 <= max_points <= settings.FLUXRL_METRICS_MAX_POINTS:
        raise field_error("max_points", f"between 1 and {settings.FLUXRL_METRICS_MAX_POINTS}")
    points = MetricPoint.objects.filter(run=run)
    if keys:
        points = points.filter(key__in=keys)
    if since_step is not None:
        points = points.filter(step__gt=since_step)
    series = {}
    rows = points.order_by("key", "step").values_list("key", "step", "value", "time").iterator(chunk_size=5000)
    for key, group in groupby(rows, key=lambda row: row[0]):
        full = [row[1:] for row in group]
        kept = downsample(full, max_points)
        series[key] = {
            "step": [p[0] for p in kept], "value": [p[1] for p in kept], "time": [p[2] for p in kept],
            "count": len(full), "downsampled": len(kept) < len(full),
        }
    return series


def read_points(run, keys: list[str] | None = None, since_step: int | None = None, max_points: int = 1000) -> list[dict]:
    """read_series flattened to points [{key, step, value, time}] ordered by step, the
    shape live views receive (the history on connect, then each ingested batch)."""
    points = [
        {"key": key, "step": step, "value": value, "time": when}
        for key, series in read_series(run, keys, since_step, max_points).items()
        for step, value, when in zip(series["step"], series["value"], series["time"])
    ]
    return sorted(points, key=lambda p: (p["step"], p["key"]))
