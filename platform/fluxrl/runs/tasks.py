"""Celery tasks for runs, thin on purpose: the work is in dispatch.py. Queues, acks_late,
prefetch 1 and the broker's visibility timeout are set in settings (CELERY_*).
services.enqueue_run sends them; nothing here or in dispatch.py imports services."""
from celery import shared_task
from celery.signals import worker_ready

from . import dispatch


# acks_late: the message is acknowledged when the run ends, so a worker host lost before
# the engine started leaves it to another worker; a redelivery of a run that did start
# finds it no longer queued (the reaper failed it) and does nothing.
@shared_task(acks_late=True, ignore_result=True)
def execute_run(run_id: int) -> str:
    return dispatch.execute_run(run_id)


# One per node after the first of a run over several nodes (services.enqueue_run): the
# node agent joins node 0's coordinator; acks_late as for execute_run.
@shared_task(acks_late=True, ignore_result=True)
def join_run(run_id: int, node_rank: int) -> str:
    return dispatch.join_run(run_id, node_rank)


@shared_task(ignore_result=True)
def reap_stale_runs() -> list[int]:
    return dispatch.reap_stale_runs()


@worker_ready.connect
def reap_when_a_worker_starts(**_):
    # Runs left live by a worker that died (reboot, OOM kill) are failed as soon as a
    # worker is back, even where no beat process runs.
    dispatch.reap_stale_runs()
