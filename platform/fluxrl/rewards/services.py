"""Reward functions: built-ins (workers.tasks.builtin_rewards) and a team's versioned Python code,
and "try it", which scores a few rows in workers.rewards.sandbox — never in the web process."""
from __future__ import annotations

import ast
import inspect
import logging
import threading
import time

from django.conf import settings
from django.db import connection, transaction

import workers.tasks.builtin_rewards
from fluxrl.datasets.services import read_rows
from fluxrl.errors import Conflict, DomainError, InvalidInput, TooManyRequests, field_error
from fluxrl.versioned import check_name, find_version, next_version_number
from workers.tasks.builtin_rewards import BUILTIN_REWARDS
from workers.rewards.sandbox import try_reward
from workers.rewards.sandbox_boundary import sandbox_status

from . import scoring
from .models import RewardFunction, RewardVersion
from .tasks import sandbox_check
from .tasks import try_reward as try_task

log = logging.getLogger(__name__)


# reward.function values with a meaning of their own in a run spec (workers/spec/reward.py)
RESERVED_NAMES = {"user", "sum"}


def builtin_catalog() -> list[dict]:
    return [{"name": name, "description": inspect.getdoc(fn) or ""} for name, fn in BUILTIN_REWARDS.items()]


def builtin_code(name: str) -> str:
    """Source that defines `reward` as a built-in, so built-ins are tried in the same
    sandbox as user code (their fields, e.g. a regex pattern, come from the user)."""
    return inspect.getsource(workers.tasks.builtin_rewards) + f"\nreward = {name}\n"


def check_code(code: str) -> None:
    """Parse (never run) the code: syntax errors and a missing `reward` are reported at once."""
    if len(code.encode()) > settings.FLUXRL_REWARD_CODE_MAX_BYTES:
        raise field_error("code", f"longer than {settings.FLUXRL_REWARD_CODE_MAX_BYTES} bytes")
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        raise field_error("code", f"line {exc.lineno}: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise field_error("code", f"cannot be parsed ({type(exc).__name__})") from None
    defines_reward = any(
        (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "reward")
        or (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "reward" for t in node.targets))
        or (isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == "reward" for a in node.names))
        for node in tree.body
    )
    if not defines_reward:
        raise field_error("code", "must define a function reward(prompt, completion, **fields) -> float")


@transaction.atomic
def create_function(team, user, name: str, code: str, description: str = "") -> RewardVersion:
    check_name(name)
    if name in BUILTIN_REWARDS:
        raise field_error("name", f"'{name}' is a built-in reward; choose another name")
    if name in RESERVED_NAMES:
        raise field_error("name", f"'{name}' has a meaning of its own in reward.function; choose another name")
    check_code(code)
    if RewardFunction.objects.filter(team=team, name=name).exists():
        raise Conflict(f"Reward function '{name}' exists in '{team.slug}'; add a version to it instead.",
                       fields={"name": "already exists"})
    function = RewardFunction.objects.create(team=team, name=name, description=description, created_by=user)
    return RewardVersion.objects.create(function=function, version=1, code=code, created_by=user)


@transaction.atomic
def add_version(function: RewardFunction, user, code: str) -> RewardVersion:
    check_code(code)
    function = RewardFunction.objects.select_for_update().get(pk=function.pk)
    return RewardVersion.objects.create(function=function, version=next_version_number(function), code=code, created_by=user)


def get_version(team, ref: str, field: str = "function") -> RewardVersion:
    """The team's reward version named by 'name@version' (or the newest for 'name')."""
    return find_version(RewardVersion.objects.select_related("function"), "function", team, ref, field)


def code_for(team, function: str) -> str:
    """Code to try for a built-in name or a team's 'name@version'."""
    return builtin_code(function) if function in BUILTIN_REWARDS else get_version(team, function).code


SERVICE_STATE_TTL_S = (300.0, 30.0)  # how long the sandbox service's answer is kept: (available, not)
SERVICE_STATE_WAIT_S = 5.0
_service_state: tuple[float, dict | None] = (0.0, None)
_service_state_lock = threading.Lock()


def sandbox_state() -> dict:
    """Whether reward code can be contained where try-it scores: {available, reason}. A
    real sandbox is started to prove it (workers.rewards.sandbox.sandbox_status): in this process
    (once while it works, at most every 30 s while it does not), or, with FLUXRL_TRY_QUEUE,
    in the sandbox service, which is asked at most every 5 min (30 s while it says no or
    does not answer). Cheap enough for every request."""
    queue = settings.FLUXRL_TRY_QUEUE
    if not queue:
        available, reason = sandbox_status()
        return {"available": available, "reason": reason}
    global _service_state
    with _service_state_lock:
        checked_at, state = _service_state
        if state is not None and time.monotonic() - checked_at < SERVICE_STATE_TTL_S[0 if state["available"] else 1]:
            return state
        try:
            pending = sandbox_check.apply_async(queue=queue, expires=SERVICE_STATE_WAIT_S, retry=False)
            try:
                available, reason = pending.get(timeout=SERVICE_STATE_WAIT_S, disable_sync_subtasks=False)
            finally:
                pending.forget()
            state = {"available": bool(available), "reason": f"sandbox service: {reason}"}
        except Exception as exc:  # broker down, no worker on the queue, an old worker without the task
            log.warning("sandbox state: the sandbox service did not answer: %r", exc)
            state = {"available": False, "reason": f"the reward sandbox service (queue '{queue}') did not answer "
                                                   f"within {SERVICE_STATE_WAIT_S:g} s ({type(exc).__name__})"}
        _service_state = (time.monotonic(), state)
        return state


def forget_sandbox_state() -> None:
    """Ask afresh at the next sandbox_state()."""
    global _service_state
    with _service_state_lock:
        _service_state = (0.0, None)


# --- try it ------------------------------------------------------------------------------


def rows_from_dataset(version, n: int, completions: list[str] | None = None) -> list[dict]:
    """The first n rows of a dataset version as try-rows; completion = the row's answer
    unless completions are given (one per row)."""
    rows = read_rows(version, 0, n)
    if completions is not None and len(completions) != len(rows):
        raise field_error("completions", f"give one completion per row ({len(rows)} rows)")
    return [
        {"prompt": row["prompt"], "completion": completions[i] if completions is not None else row["answer"],
         "fields": {k: v for k, v in row.items() if k != "prompt"}}
        for i, row in enumerate(rows)
    ]


_try_slots: dict[int, threading.BoundedSemaphore] = {}
_try_slots_lock = threading.Lock()


def _try_slot() -> threading.BoundedSemaphore:
    limit = settings.FLUXRL_TRY_MAX_CONCURRENT
    with _try_slots_lock:
        return _try_slots.setdefault(limit, threading.BoundedSemaphore(limit))


def try_code(code: str, rows: list[dict], timeout_s: float | None = None, memory_mb: int = 256,
             rows_field: str = "rows") -> dict:
    """Score rows ({prompt, completion, fields}) in the sandbox. Errors in the code come
    back in the result ({"ok": false, "error" or per-row "error"}), never as exceptions.
    The work is bounded (rows x per-row timeout <= FLUXRL_TRY_MAX_SECONDS; without a
    timeout_s, the per-row timeout is min(2 s, that bound / rows)) and so is the number of
    tries running at once (429 past FLUXRL_TRY_MAX_CONCURRENT). rows_field: the request
    field the rows came from, named by the errors ("n" for rows read from a dataset).
    Call it from a thread, never an event loop: it blocks while the sandbox scores (the
    API's sync views run in a worker thread under ASGI)."""
    if not rows:
        raise field_error(rows_field, "give at least one row")
    if len(rows) > settings.FLUXRL_REWARD_TRY_MAX_ROWS:
        raise field_error(rows_field, f"at most {settings.FLUXRL_REWARD_TRY_MAX_ROWS} rows")
    bound = settings.FLUXRL_TRY_MAX_SECONDS
    if timeout_s is None:
        timeout_s = min(2.0, bound / len(rows))
    timeout_s = min(timeout_s, settings.FLUXRL_REWARD_TRY_MAX_TIMEOUT_S)
    if len(rows) * timeout_s > bound + 1e-9:
        message = (f"{len(rows)} rows x {timeout_s:g} s per row exceed the {bound:g} s a try may take: "
                   f"give {'fewer rows' if rows_field == 'rows' else 'a smaller ' + rows_field} or a shorter timeout_s")
        raise InvalidInput(message, fields={rows_field: message, "timeout_s": message})
    slot = _try_slot()
    if not slot.acquire(blocking=False):
        raise TooManyRequests(f"{settings.FLUXRL_TRY_MAX_CONCURRENT} tries are already running: try again shortly",
                              retry_after_s=max(1, int(bound)))
    try:
        if not connection.in_atomic_block:
            # Not held while the sandbox scores (seconds): back to the pool for other requests.
            # Nothing below needs the database; a later query would simply reconnect.
            connection.close()
        outcome = _score(code, rows, timeout_s, memory_mb)
    finally:
        slot.release()
    outcome["results"] = [
        {"prompt": row["prompt"], "completion": row["completion"], **result}
        for row, result in zip(rows, outcome["results"])
    ]
    return outcome


# --- where try-it scores: here, or in the sandbox service --------------------------------


class SandboxServiceUnavailable(DomainError):
    status, code = 503, "sandbox_unavailable"
    retry_after_s = 5


def score_here(code: str, rows: list[dict], timeout_s: float, memory_mb: int) -> dict:
    """Score in a sandbox child of this (the web) process, the embedded default: what the
    sandbox service's task does (scoring.score_here), through this module's try_reward."""
    return scoring.score_here(code, rows, timeout_s, memory_mb, score=try_reward)


def _score(code: str, rows: list[dict], timeout_s: float, memory_mb: int) -> dict:
    """With FLUXRL_TRY_QUEUE set, the sandbox service scores (the web container has no
    privileges to make namespaces); the web process waits at most FLUXRL_TRY_DEADLINE_S
    and answers 503 past it. Unset: a sandbox child of this process."""
    queue = settings.FLUXRL_TRY_QUEUE
    if not queue:
        return score_here(code, rows, timeout_s, memory_mb)
    from celery.exceptions import TimeoutError as ResultTimeout
    from kombu.exceptions import OperationalError

    deadline = settings.FLUXRL_TRY_DEADLINE_S
    unavailable = (f"the reward sandbox service did not answer within {deadline:g} s "
                   f"(no worker on the '{queue}' queue?): try again shortly")
    try:
        # expires: a worker that starts after the deadline drops the try instead of scoring for nobody
        pending = try_task.apply_async((code, rows, timeout_s, memory_mb), queue=queue, expires=deadline,
                                       retry=False)
    except OperationalError as exc:
        log.warning("try-it: broker unreachable: %s", exc)
        raise SandboxServiceUnavailable(f"the reward sandbox service cannot be reached ({type(exc).__name__}): "
                                        "try again shortly") from None
    try:
        outcome = pending.get(timeout=deadline, propagate=False, disable_sync_subtasks=False)
    except ResultTimeout:
        pending.revoke()
        raise SandboxServiceUnavailable(unavailable) from None
    finally:
        pending.forget()
    if not isinstance(outcome, dict):  # the task raised (outcome is the exception) or was revoked
        log.warning("try-it: the sandbox service failed: %r", outcome)
        raise SandboxServiceUnavailable(f"the reward sandbox service failed ({type(outcome).__name__}): "
                                        "try again shortly")
    by = outcome.get("scored_by", {})
    log.info("try-it: %d rows scored by %s pid %s", len(rows), by.get("host"), by.get("pid"))
    return outcome
