"""The try-it task, consumed only by the `sandbox` service (fluxrl.rewards.sandbox_app,
`celery -A fluxrl.rewards.sandbox_app worker -Q sandbox`): the one container with the
privileges bubblewrap needs. Thin on purpose: services.score_here does the work."""
from celery import shared_task

TRY_TASK = "fluxrl.rewards.tasks.try_reward"


# No acks_late: a try that a dying worker drops is answered 503 by the web process at its
# deadline; running it again later would score for nobody. The result is the answer.
@shared_task(name=TRY_TASK, ignore_result=False)
def try_reward(code: str, rows: list[dict], timeout_s: float, memory_mb: int) -> dict:
    from . import services  # after Django is set up (the worker's fixup imports tasks early)

    return services.score_here(code, rows, timeout_s, memory_mb)


@shared_task(name="fluxrl.rewards.tasks.sandbox_check", ignore_result=False)
def sandbox_check() -> tuple[bool, str]:
    """(available, reason) of this service's sandbox, for GET /api/me/ and the dashboard."""
    from workers.sandbox import sandbox_status

    return sandbox_status()
