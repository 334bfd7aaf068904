"""Celery tasks for runs, thin on purpose: the work is in dispatch.py. Queues, acks_late,
prefetch 1 and the broker's visibility timeout are set in settings (CELERY_*).
services.enqueue_run sends them; nothing here or in dispatch.py imports services."""
from celery import shared_task
from celery.signals import worker_process_init, worker_ready
from django.conf import settings

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
def reap_stale_runs(until_in_contact: bool = False) -> list[int]:
    reaped = dispatch.reap_stale_runs()
    short_s = dispatch.contact_short_of_window_s()
    if until_in_contact and short_s > 0:
        # the process that took it has not watched the database for a window yet (a pool
        # child slow to start): it reaped nothing, so try again once it has
        reap_stale_runs.apply_async(kwargs={"until_in_contact": True}, countdown=short_s + dispatch.contact_every_s())
    return reaped


@worker_process_init.connect
def watch_the_database_from_each_pool_process(**_):
    # beat's reap task lands on any prefork child: each watches the database from its start,
    # so whichever gets it knows whether the database was there over the last window.
    dispatch.keep_contact()


@worker_ready.connect
def reap_when_a_worker_starts(sender=None, **_):
    # Runs left live by a worker that died (reboot, OOM kill) are failed once a worker is
    # back, even where no beat process runs: one stale window after it started, not at once
    # (a worker started just after a database outage must leave the other workers' watchers
    # a window to beat again; dispatch.DatabaseContact).
    pool = getattr(sender, "pool", None)
    if pool is None or not type(pool).__module__.endswith("prefork"):
        dispatch.keep_contact()  # solo / threads pools run tasks in this process
    reap_stale_runs.apply_async(kwargs={"until_in_contact": True},
                                countdown=settings.FLUXRL_RUN_STALE_S + 2 * dispatch.contact_every_s())
