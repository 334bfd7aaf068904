"""What a live view of a run (runs/consumers.py) gets on connect: the run's status, its
metric history and its recent samples, in the messages runs/live.py defines. In the
metrics app, which builds on runs, because it reads metric points (services.read_points)."""
from __future__ import annotations

from fluxrl.runs import live
from fluxrl.runs.models import Run

from .services import read_points

RECENT_SAMPLES = 20  # sent on connect; the samples API has the rest
# daphne closes a socket (1011) rather than send a message over 1 MiB: the history on
# connect (up to max_points per series, ~90 bytes a point) goes in messages of this many.
HISTORY_POINTS_PER_MESSAGE = 5000


def snapshot(run: Run, since_step: int | None = None, max_points: int = 1000) -> list[dict]:
    """What a subscriber gets on connect: the status, the metric history after
    since_step (each series downsampled to max_points; in one or more messages), and
    the recent samples."""
    run.refresh_from_db()
    samples = run.samples.all()
    if since_step is not None:
        samples = samples.filter(step__gt=since_step)
    recent = list(samples.order_by("-step", "-id")[:RECENT_SAMPLES])[::-1]
    points = read_points(run, since_step=since_step, max_points=max_points)
    size = HISTORY_POINTS_PER_MESSAGE
    return [
        live.status_message(run),
        *({"type": "metrics", "points": points[i:i + size], "history": True} for i in range(0, max(len(points), 1), size)),
        *live.sample_messages([live.sample_dict(s) for s in recent], history=True),
    ]
