"""The environment try-it task, consumed only by the `sandbox` service
(fluxrl.rewards.sandbox_app): thin on purpose, trying.try_here does the work. Nothing here
needs Django or imports services, which sends it."""
from celery import shared_task

from . import trying

TRY_TASK = "fluxrl.environments.tasks.try_environment"


# No acks_late: a try a dying worker drops is answered 503 by the web process at its deadline.
@shared_task(name=TRY_TASK, ignore_result=False)
def try_environment(code: str, row: dict, turns: list[str], params: dict, timeout_s: float, memory_mb: int,
                    output_chars: int) -> dict:
    return trying.try_here(code, row, turns, params, timeout_s, memory_mb, output_chars)
