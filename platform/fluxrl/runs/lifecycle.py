"""A run's status state machine (transition) and whether its engine resumes from a
checkpoint: shared by services (submission, cancelling, the engine's reports) and by
dispatch (the worker host that runs the engine), which do not import each other."""
from __future__ import annotations

from functools import partial

from django.db import transaction
from django.utils import timezone

from fluxrl.accounts.services import revoke_run_tokens
from fluxrl.errors import Conflict

from . import live
from .models import TERMINAL_STATUSES, Run, RunStatus

ALLOWED_TRANSITIONS = {
    RunStatus.QUEUED: {RunStatus.STARTING, RunStatus.FAILED, RunStatus.CANCELLED},
    RunStatus.STARTING: {RunStatus.RUNNING, RunStatus.FAILED, RunStatus.CANCELLED},
    RunStatus.RUNNING: {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED},
}


class IllegalTransition(Conflict):
    code = "illegal_transition"


@transaction.atomic
def transition(run: Run, status: str, *, failure_reason: str = "", worker_host: str | None = None,
               worker_pid: int | None = None, rendezvous: str | None = None,
               resumed_from_step: int | None = None, engine_pools: list | None = None,
               engine_pools_attested: bool = False) -> Run:
    """Move a run along queued -> starting -> running -> succeeded/failed/cancelled
    (any live state may fail or be cancelled; a failure after a cancel request counts as
    cancelled). Reporting the current status again is a heartbeat. Reaching a terminal
    state revokes the run's tokens. Raises IllegalTransition (HTTP 409) for any other move.
    ``resumed_from_step``: sent by an engine started with --resume as it starts running;
    the points and samples after that step are dropped (prune_after), as it computes them again."""
    run = Run.objects.select_for_update().get(pk=run.pk)
    now = timezone.now()
    if status == RunStatus.FAILED and run.cancel_requested:
        status = RunStatus.CANCELLED  # an engine stopped on request may report the interruption as a failure
    if status != run.status:
        if status not in ALLOWED_TRANSITIONS.get(run.status, ()):
            raise IllegalTransition(f"A run cannot go from {run.status} to {status}.",
                                    fields={"status": f"not allowed from {run.status}"})
        if status == RunStatus.RUNNING and resumed_from_step is not None:
            # Only as it starts running: a later report of the same step must not drop
            # the points the resumed engine has sent since.
            prune_after(run, resumed_from_step)
        run.status = status
        if status == RunStatus.RUNNING:
            run.started_at = now
        if status in TERMINAL_STATUSES:
            run.finished_at = now
            run.failure_reason = failure_reason if status == RunStatus.FAILED else ""
    if not run.is_terminal:
        run.heartbeat_at = now
    if worker_host is not None:
        run.worker_host = worker_host
    if worker_pid is not None:
        run.worker_pid = worker_pid
    if rendezvous is not None:
        run.rendezvous = rendezvous
    if engine_pools is not None and not run.is_terminal:
        run.engine_pools = [dict(p) for p in engine_pools]
        run.engine_pools_attested = engine_pools_attested
    run.save()
    if run.is_terminal:
        revoke_run_tokens(run)
    transaction.on_commit(partial(live.publish_status, run))
    return run


def prune_after(run: Run, step: int) -> tuple[int, int]:
    """Drop the run's metric points and samples after ``step`` (a resumed engine computes
    those steps again; -1: all of them); returns how many (points, samples)."""
    points, _ = run.metric_points.filter(step__gt=step).delete()  # MetricPoint's reverse accessor: metrics builds on runs
    samples, _ = run.samples.filter(step__gt=step).delete()
    return points, samples


def resume_from_checkpoint(run: Run) -> bool:
    """Whether the dispatcher starts this run's engine with --resume: it has reported a
    checkpoint (only a run queued again by resume_run can have one when it starts)."""
    return run.checkpoints.exists()
