"""Live updates of a run for its page: what is pushed to the Channels group run-<id>,
and who may subscribe. RunConsumer (consumers.py) forwards it. What a subscriber gets on
connect, with the metric history, is fluxrl.metrics.live.snapshot (metrics builds on
runs; the domain modules of runs never import metrics).

Messages (docs/architecture.md §7): {"type": "status", ...}, {"type": "metrics", "points": [...]},
{"type": "samples", "samples": [...]}. Points are keyed by (key, step); a retried batch
may be pushed twice, so subscribers overwrite rather than append blindly.
"""
from __future__ import annotations

import json
import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from fluxrl.accounts.models import ApiToken, RunToken, Scope
from fluxrl.accounts.services import visible_teams
from fluxrl.errors import Forbidden, NotFound, Unauthorized

from .models import Run, Sample

log = logging.getLogger(__name__)

# Samples go in messages of at most this many bytes of JSON (with their per-token texts
# they can be long): a sample larger than that alone is sent in a message of its own.
SAMPLE_BYTES_PER_MESSAGE = 512 * 1024


def group_name(run_id: int) -> str:
    return f"run-{run_id}"


def publish(run_id: int, message: dict) -> None:
    """Push a message to the run's subscribers. Best effort: live views catch up on
    reconnect (since_step), so a channel-layer outage must not fail a worker's report."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(group_name(run_id), {"type": "run.event", "message": message})
    except Exception:  # noqa: BLE001 - e.g. Redis down; the data is stored already
        log.warning("could not push %s to run %s", message.get("type"), run_id, exc_info=True)


def iso(when) -> str | None:
    return when.isoformat() if when else None


def status_message(run: Run) -> dict:
    return {
        "type": "status", "run": run.pk, "status": run.status, "failure_reason": run.failure_reason,
        "cancel_requested": run.cancel_requested, "started_at": iso(run.started_at),
        "finished_at": iso(run.finished_at), "heartbeat_at": iso(run.heartbeat_at),
        "worker_host": run.worker_host, "worker_pid": run.worker_pid,
    }


def sample_dict(sample: Sample) -> dict:
    return {"uid": sample.uid, "step": sample.step, "prompt": sample.prompt, "completion": sample.completion,
            "reward": sample.reward, "version_runs": sample.version_runs, "tokens": sample.tokens,
            "length": sample.length, "error": sample.error, "episode": sample.episode}


def sample_messages(samples: list[dict], **extra) -> list[dict]:
    """{"type": "samples"} messages holding `samples` in order, each within
    SAMPLE_BYTES_PER_MESSAGE of JSON (as the consumer encodes it) unless one sample alone
    is larger, under daphne's 1 MiB frame limit."""
    messages, batch, size = [], [], 0
    for sample in samples:
        nbytes = len(json.dumps(sample)) + 2
        if batch and size + nbytes > SAMPLE_BYTES_PER_MESSAGE:
            messages.append(batch)
            batch, size = [], 0
        batch.append(sample)
        size += nbytes
    if batch or not messages:
        messages.append(batch)
    return [{"type": "samples", "samples": batch, **extra} for batch in messages]


def publish_status(run: Run) -> None:
    publish(run.pk, status_message(run))


def publish_samples(run: Run, samples: list[Sample]) -> None:
    if samples:
        for message in sample_messages([sample_dict(s) for s in samples]):
            publish(run.pk, message)


def publish_points(run: Run, keys: list, steps: list, values: list, times: list) -> None:
    """One group message per ingested batch, as columns: far cheaper to copy (in-memory
    layer) or encode (Redis) than a dict per point. Consumers expand it (client_message)."""
    if keys:
        publish(run.pk, {"type": "metrics", "columns": [list(keys), list(steps), list(values), list(times)]})


def client_message(message: dict) -> dict:
    """A group message as a subscriber receives it: metrics as points [{key, step, value, time}]."""
    if message["type"] == "metrics" and "columns" in message:
        points = [{"key": k, "step": s, "value": v, "time": t} for k, s, v, t in zip(*message["columns"])]
        return {"type": "metrics", "points": points}
    return message


# --- subscribing ---------------------------------------------------------------------


def run_for_subscriber(user, token, run_id: int) -> Run:
    """The run a websocket client may follow: it must be signed in (session or a user
    API token with the read scope) and a member of the run's team. Another team's run
    and a missing one get the same 404 from the same one query (no run-id oracle); the
    token checks come first, as they do not depend on the run."""
    if user is None or not user.is_authenticated:
        raise Unauthorized("Sign in, or pass an API token (Authorization header or ?token=).")
    if isinstance(token, RunToken) or (isinstance(token, ApiToken) and Scope.READ not in token.scopes):
        raise Forbidden("This token may not read runs.")
    run = Run.objects.filter(pk=run_id, team__in=visible_teams(user, token)).first()
    if run is None:
        raise NotFound(f"No run {run_id} among your teams' runs.")
    return run


def current_status(run_id: int) -> dict | None:
    run = Run.objects.filter(pk=run_id).first()
    return status_message(run) if run else None
