"""Metric points: idempotent batch ingest from workers and downsampled range reads."""
from __future__ import annotations

import contextlib
import math
import re
import time
from collections import defaultdict

from django.conf import settings
from django.db import IntegrityError, connection, transaction

from fluxrl.errors import TooLarge, field_error
from fluxrl.runs import live
from fluxrl.runs.models import MAX_STEP

from .models import MetricPoint

# "@": eval/<set>/pass@<k> and avg@<n> (docs/architecture.md §5)
KEY_PATTERN = re.compile(r"[A-Za-z0-9_./:@-]{1,100}")


def is_number(value) -> bool:
    try:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def clean_point(index: int, point) -> tuple[str, int, float, float]:
    where = f"points.{index}"
    if not isinstance(point, dict):
        raise field_error(where, "expected an object {key, step, value, time}")
    key, step, value, when = point.get("key"), point.get("step"), point.get("value"), point.get("time")
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        raise field_error(f"{where}.key", "1-100 characters of letters, digits and _ . / : @ -")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise field_error(f"{where}.step", "a whole number >= 0 (64-bit)")
    if not is_number(value):
        raise field_error(f"{where}.value", "a finite number")
    if when is not None and not is_number(when):
        raise field_error(f"{where}.time", "unix seconds")
    return key, step, float(value), float(when if when is not None else time.time())


class _Invalid(Exception):
    """Some point of the batch is bad: check point by point to name it."""


def _finite_numbers(values: list, nullable: bool = False) -> list[float]:
    types = set(map(type, values))
    if not types <= ({int, float, type(None)} if nullable else {int, float}):
        raise _Invalid
    if types == {float}:
        floats = values
    elif nullable and type(None) in types:
        now = time.time()
        floats = [now if v is None else float(v) for v in values]
    else:
        try:
            floats = list(map(float, values))
        except OverflowError:
            raise _Invalid from None
    if not all(map(math.isfinite, floats)):
        raise _Invalid
    return floats


def _clean_columns(points: list) -> tuple[list[str], list[int], list[float], list[float]]:
    """The batch as columns (keys, steps, values, times), checked column by column with
    C-level builtins (map, set, min, max): a 1000-point batch costs a few passes, not
    4000 isinstance calls, and each distinct key is matched once."""
    try:
        keys = [p["key"] for p in points]
        steps = [p["step"] for p in points]
        values = [p["value"] for p in points]
        times = [p.get("time") for p in points]
        distinct = set(keys)
    except (TypeError, KeyError, AttributeError):  # not an object, a field missing, a key unhashable
        raise _Invalid from None
    if not all(type(k) is str and KEY_PATTERN.fullmatch(k) for k in distinct):
        raise _Invalid
    if set(map(type, steps)) != {int} or min(steps) < 0 or max(steps) > MAX_STEP:  # bool is not int here
        raise _Invalid
    return keys, steps, _finite_numbers(values), _finite_numbers(times, nullable=True)


def clean_points(points) -> tuple[list[str], list[int], list[float], list[float]]:
    """Columns (keys, steps, values, times) of a valid batch, one entry per (key, step):
    the last value given for a (key, step) in the batch. A bad point rejects the batch
    with a 400 naming it (points.<index>.<field>)."""
    if not isinstance(points, list):
        raise field_error("points", "expected a list")
    if len(points) > settings.FLUXRL_INGEST_MAX_POINTS:
        raise TooLarge(f"{len(points)} points in one batch; the limit is {settings.FLUXRL_INGEST_MAX_POINTS}.")
    if not points:
        return [], [], [], []
    try:
        keys, steps, values, times = _clean_columns(points)
    except _Invalid:
        for index, point in enumerate(points):
            clean_point(index, point)  # raises for the first bad point
        raise AssertionError("a batch failed the bulk checks but no point did") from None
    pairs = list(zip(keys, steps))
    if len(set(pairs)) != len(pairs):
        # A (key, step) repeated in the batch: one row, in its first place, with its last value.
        last = {pair: i for i, pair in enumerate(pairs)}  # dicts keep first-insertion order
        keys, steps = [k for k, _ in last], [s for _, s in last]
        values, times = [values[i] for i in last.values()], [times[i] for i in last.values()]
    return keys, steps, values, times


def ingest_points(run, points: list) -> int:
    """Store a batch of points [{key, step, value, time}] for a run; returns how many
    distinct (key, step) it held. Idempotent: a point whose (run, key, step) is stored
    already is replaced, so a retried batch stores nothing twice, and a step a resumed
    engine computes again holds its new value (the last value sent wins).
    More than FLUXRL_INGEST_MAX_POINTS -> 413."""
    columns = clean_points(points)
    if columns[0]:
        insert_points(run, *columns)
        on_points_stored(run, columns)
    return len(columns[0])


def insert_points(run, keys: list[str], steps: list[int], values: list[float], times: list[float]) -> None:
    """Insert cleaned columns; a (run, key, step) stored already takes the new value and time.

    PostgreSQL: a batch is nearly always new points, so it goes in by binary COPY, the
    cheapest way in for both sides (no SQL text, numbers as binary), inside a savepoint.
    A batch holding a point stored before (a retry, or a step recomputed after a resume)
    fails that COPY whole on the unique (run, key, step) index; then one
    INSERT ... ON CONFLICT DO UPDATE stores it all.
    Rows go in (key, step) order, so concurrent batches touching the same points take
    their index locks in one order and cannot deadlock."""
    method = settings.FLUXRL_INGEST_INSERT if connection.vendor == "postgresql" else "orm"
    if method == "orm":  # SQLite
        MetricPoint.objects.bulk_create(
            [MetricPoint(run=run, key=k, step=s, value=v, time=t) for k, s, v, t in zip(keys, steps, values, times)],
            update_conflicts=True, unique_fields=["run", "key", "step"], update_fields=["value", "time"])
        return
    rows = sorted(zip(keys, steps, values, times))  # (key, step) is unique here
    table = MetricPoint._meta.db_table
    with connection.cursor() as cursor:
        if method == "copy":
            # In autocommit the COPY is a transaction of its own, so a failed one leaves
            # nothing behind (no BEGIN, SAVEPOINT, COMMIT round trips); inside a caller's
            # transaction a savepoint does that.
            isolated = transaction.atomic() if connection.in_atomic_block else contextlib.nullcontext()
            try:
                with isolated, connection.wrap_database_errors:
                    with cursor.cursor.copy(f"COPY {table} (run_id, key, step, value, time) FROM STDIN (FORMAT BINARY)") as copy:
                        copy.set_types(["int8", "text", "int8", "float8", "float8"])
                        for row in rows:
                            copy.write_row((run.pk, *row))
                return
            except IntegrityError:
                pass  # some point is stored already
        cursor.execute(f"INSERT INTO {table} (run_id, key, step, value, time) "
                       "SELECT %s, * FROM unnest(%s::text[], %s::bigint[], %s::float8[], %s::float8[]) "
                       "ON CONFLICT (run_id, key, step) DO UPDATE SET value = EXCLUDED.value, time = EXCLUDED.time",
                       [run.pk, *map(list, zip(*rows))])


def on_points_stored(run, columns: tuple[list, list, list, list]) -> None:
    """Called after every ingested batch (retries included, so consumers key points by
    (key, step)): one push to the run's live views, downsampled per key to about
    FLUXRL_LIVE_MAX_POINTS points (the API has them all)."""
    live.publish_points(run, *live_columns(*columns, limit=settings.FLUXRL_LIVE_MAX_POINTS))


def live_columns(keys, steps, values, times, limit: int) -> tuple[list, list, list, list]:
    """The batch's columns as they are, or past `limit` points each key's series cut
    by downsample (first, last and extremes kept)."""
    if len(keys) <= limit:
        return keys, steps, values, times
    series = defaultdict(list)
    for key, step, value, when in zip(keys, steps, values, times):
        series[key].append((step, value, when))
    share = max(limit // len(series), 2)
    kept = [(key, *point) for key, rows in series.items() for point in downsample(sorted(rows), share)]
    return tuple(map(list, zip(*kept)))


# --- reads ------------------------------------------------------------------------------


def downsample(points, max_points: int, total: int | None = None) -> list[tuple]:
    """At most max_points of (step, value, time), keeping the first and the last point
    and, in each bucket between, its minimum and maximum, so spikes stay visible.
    `points` may be an iterator over `total` points: it is read once, so a long series
    never sits in memory whole."""
    if total is None or max_points < 4:
        points = list(points)
        total = len(points)
    if total <= max_points:
        kept = list(points)
        return kept if len(kept) <= max_points else downsample(kept, max_points)  # more stored since counted
    if max_points < 4:
        stride = (total - 1) / max(max_points - 1, 1)
        picks = sorted({total - 1, *(round(i * stride) for i in range(max_points - 1))})
        return [points[i] for i in picks]
    buckets = (max_points - 2) // 2
    size = math.ceil((total - 2) / buckets)
    points = iter(points)
    kept, low, high, bucket, last = [next(points)], None, None, 0, None
    for position, point in enumerate(points):
        if last is not None:  # not the final point: it falls in a middle bucket
            index = min((position - 1) // size, buckets - 1)
            if index != bucket and low is not None:
                kept.extend(sorted({low, high}))
                low = None
            bucket = index
            if low is None:
                low = high = last
            elif last[1] < low[1]:
                low = last
            elif last[1] > high[1]:
                high = last
        last = point
    if low is not None:
        kept.extend(sorted({low, high}))
    if last is not None:
        kept.append(last)
    return kept


def last_steps(run) -> dict[str, int]:
    """{key: last step} of the run's series. A loose index scan: one seek per key on the
    unique (run, key, step) index, so a run of millions of points answers at once."""
    table = MetricPoint._meta.db_table
    sql = f"""
        WITH RECURSIVE keys(key) AS (
            SELECT MIN(key) FROM {table} WHERE run_id = %s
            UNION ALL
            SELECT (SELECT MIN(key) FROM {table} WHERE run_id = %s AND key > keys.key) FROM keys WHERE keys.key IS NOT NULL
        )
        SELECT key, (SELECT MAX(step) FROM {table} WHERE run_id = %s AND key = keys.key) FROM keys WHERE key IS NOT NULL
    """
    with connection.cursor() as cursor:
        cursor.execute(sql, [run.pk, run.pk, run.pk])
        return dict(cursor.fetchall())


def stream_points(run, key: str, since_step: int | None, chunk: int = 10_000):
    """(step, value, time) of one series in step order. A plain cursor: the ORM's row
    building costs more than the query for a series of 100,000 points."""
    sql = (f"SELECT step, value, time FROM {MetricPoint._meta.db_table} "
           "WHERE run_id = %s AND key = %s AND step > %s ORDER BY step")
    with connection.cursor() as cursor:
        cursor.execute(sql, [run.pk, key, -1 if since_step is None else since_step])
        while rows := cursor.fetchmany(chunk):
            yield from rows


def read_series(run, keys: list[str] | None = None, since_step: int | None = None, max_points: int = 1000) -> dict:
    """{key: {"step": [...], "value": [...], "time": [...], "count": n, "downsampled": bool}}
    for the run's points with step > since_step, each series cut to max_points. One
    series at a time, streamed through downsample, so memory stays at max_points a series."""
    if not 1 <= max_points <= settings.FLUXRL_METRICS_MAX_POINTS:
        raise field_error("max_points", f"between 1 and {settings.FLUXRL_METRICS_MAX_POINTS}")
    series = {}
    for key in sorted(set(keys or last_steps(run))):
        points = MetricPoint.objects.filter(run=run, key=key)
        count = (points.filter(step__gt=since_step) if since_step is not None else points).count()
        if not count:
            continue
        kept = downsample(stream_points(run, key, since_step), max_points, total=count)
        series[key] = {
            "step": [p[0] for p in kept], "value": [p[1] for p in kept], "time": [p[2] for p in kept],
            "count": count, "downsampled": len(kept) < count,
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
