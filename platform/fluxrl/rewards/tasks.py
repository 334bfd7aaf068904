"""The try-it task, consumed only by the `sandbox` service (fluxrl.rewards.sandbox_app,
`celery -A fluxrl.rewards.sandbox_app worker -Q sandbox`): the one container with the
privileges bubblewrap needs. Thin on purpose: scoring.score_here does the work. Nothing
here needs Django (the worker's fixup imports tasks early) or imports services, which
sends these tasks."""
from celery import shared_task

from workers.rewards.sandbox_boundary import sandbox_status

from . import scoring

TRY_TASK = "fluxrl.rewards.tasks.try_reward"


# No acks_late: a try that a dying worker drops is answered 503 by the web process at its
# deadline; running it again later would score for nobody. The result is the answer.
@shared_task(name=TRY_TASK, ignore_result=False)
def try_reward(code: str, rows: list[dict], timeout_s: float, memory_mb: int) -> dict:
    return scoring.score_here(code, rows, timeout_s, memory_mb)


@shared_task(name="fluxrl.rewards.tasks.sandbox_check", ignore_result=False)
def sandbox_check() -> tuple[bool, str]:
    """(available, reason) of this service's sandbox, for GET /api/me/ and the dashboard."""
    return sandbox_status()
