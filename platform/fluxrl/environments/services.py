"""Team environments: a team's versioned Python code for agentic runs, referred to in a
run spec as ``task.environment.name: name@version`` and resolved at submission to
``{name: 'user', code: ...}`` (fluxrl.runs.engine_inputs), which the run's engine runs only
in the OS sandbox (workers/agents/sandboxed.py). The web process parses the code to
report syntax errors at once; it never imports or runs it."""
from __future__ import annotations

import ast
import logging
import threading

from django.conf import settings
from django.db import connection, transaction

from fluxrl.errors import Conflict, DomainError, InvalidInput, TooManyRequests, field_error
from fluxrl.versioned import check_name, find_version, next_version_number
from workers.agents.builtin import BUILTIN_ENVIRONMENTS

from . import trying
from .models import EnvironmentVersion, TeamEnvironment

log = logging.getLogger(__name__)

# task.environment.name values with a meaning of their own in a run spec (workers/spec/task.py):
# the built-in environments (workers/agents/builtin.py) and inline code.
RESERVED_NAMES = {"user", *BUILTIN_ENVIRONMENTS}
NEEDS = "must define class Environment with reset(self, row) and step(self, text, token_ids)"


def is_team_reference(name) -> bool:
    """Whether task.environment.name names a team environment (name[@version]), not a
    built-in or inline code."""
    return isinstance(name, str) and name not in RESERVED_NAMES


def _methods(node: ast.ClassDef) -> set[str]:
    return {item.name for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}


def check_code(code: str) -> None:
    """Parse (never run) the code: its size, syntax errors and a missing Environment class
    (or its reset/step) are reported at once, naming the field ``code``."""
    limit = settings.FLUXRL_ENVIRONMENT_CODE_MAX_BYTES
    if len(code.encode()) > limit:
        raise field_error("code", f"longer than {limit} bytes")
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        raise field_error("code", f"line {exc.lineno}: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise field_error("code", f"cannot be parsed ({type(exc).__name__})") from None
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Environment"]
    bound = any(  # Environment = ... or from x import Environment: nothing to inspect
        (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "Environment" for t in node.targets))
        or (isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == "Environment" for a in node.names))
        for node in tree.body)
    if not classes and not bound:
        raise field_error("code", NEEDS)
    if classes and not bound:
        cls = classes[-1]
        missing = {"reset", "step"} - _methods(cls)
        if missing and not cls.bases:  # a base class may define them
            raise field_error("code", f"{NEEDS} (missing: {', '.join(sorted(missing))})")


@transaction.atomic
def create_environment(team, user, name: str, code: str, description: str = "") -> EnvironmentVersion:
    check_name(name)
    if name in RESERVED_NAMES:
        raise field_error("name", f"'{name}' has a meaning of its own in task.environment.name; choose another name")
    check_code(code)
    if TeamEnvironment.objects.filter(team=team, name=name).exists():
        raise Conflict(f"Environment '{name}' exists in '{team.slug}'; add a version to it instead.",
                       fields={"name": "already exists"})
    environment = TeamEnvironment.objects.create(team=team, name=name, description=description, created_by=user)
    return EnvironmentVersion.objects.create(environment=environment, version=1, code=code, created_by=user)


@transaction.atomic
def add_version(environment: TeamEnvironment, user, code: str) -> EnvironmentVersion:
    check_code(code)
    environment = TeamEnvironment.objects.select_for_update().get(pk=environment.pk)
    return EnvironmentVersion.objects.create(environment=environment, version=next_version_number(environment),
                                             code=code, created_by=user)


def get_version(team, ref: str, field: str = "environment") -> EnvironmentVersion:
    """The team's environment version named by 'name@version' (or the newest for 'name');
    another team's is not found, as if it did not exist (NotFound naming ``field``)."""
    return find_version(EnvironmentVersion.objects.select_related("environment"), "environment", team, ref, field)


# --- try it: one episode in the sandbox, never in this process ---------------------------

MAX_TRY_TURNS = 8
_try_slots: dict[int, threading.BoundedSemaphore] = {}
_try_slots_lock = threading.Lock()


class SandboxServiceUnavailable(DomainError):
    status, code = 503, "sandbox_unavailable"
    retry_after_s = 5


def _try_slot() -> threading.BoundedSemaphore:
    limit = settings.FLUXRL_TRY_MAX_CONCURRENT
    with _try_slots_lock:
        return _try_slots.setdefault(limit, threading.BoundedSemaphore(limit))


def try_code(code: str, row: dict, turns: list[str], params: dict | None = None, timeout_s: float = 2.0,
             memory_mb: int = 256, output_chars: int = 4000) -> dict:
    """Reset the environment with ``row`` and step it with each of ``turns`` (the policy's
    text) in the sandbox: {"ok", "error", "steps"}. Errors of the code come back in the
    result, never as exceptions. Bounded like reward try-it: turns x timeout_s <=
    FLUXRL_TRY_MAX_SECONDS, FLUXRL_TRY_MAX_CONCURRENT tries at once (429 past them). Call
    it from a thread, never an event loop."""
    check_code(code)
    if not turns or len(turns) > MAX_TRY_TURNS:
        raise field_error("turns", f"give 1 to {MAX_TRY_TURNS} turns")
    timeout_s = min(timeout_s, settings.FLUXRL_REWARD_TRY_MAX_TIMEOUT_S)
    bound = settings.FLUXRL_TRY_MAX_SECONDS
    if len(turns) * timeout_s > bound + 1e-9:
        message = f"{len(turns)} turns x {timeout_s:g} s exceed the {bound:g} s a try may take"
        raise InvalidInput(message, fields={"turns": message, "timeout_s": message})
    slot = _try_slot()
    if not slot.acquire(blocking=False):
        raise TooManyRequests(f"{settings.FLUXRL_TRY_MAX_CONCURRENT} tries are already running: try again shortly",
                              retry_after_s=max(1, int(bound)))
    try:
        if not connection.in_atomic_block:
            connection.close()  # not held while the sandbox runs (seconds)
        args = (code, row, list(turns), params or {}, timeout_s, memory_mb, output_chars)
        outcome = _in_service(args) if settings.FLUXRL_TRY_QUEUE else trying.try_here(*args)
    finally:
        slot.release()
    by = outcome.pop("tried_by", None) or {}  # which process ran it stays out of the API
    log.info("environment try-it: %d turns run by %s pid %s", len(outcome["steps"]), by.get("host"), by.get("pid"))
    return outcome


def _in_service(args: tuple) -> dict:
    """With FLUXRL_TRY_QUEUE set, the sandbox service runs the episode (the web container
    cannot make namespaces); past FLUXRL_TRY_DEADLINE_S the answer is 503."""
    from celery.exceptions import TimeoutError as ResultTimeout
    from kombu.exceptions import OperationalError

    from .tasks import try_environment

    queue, deadline = settings.FLUXRL_TRY_QUEUE, settings.FLUXRL_TRY_DEADLINE_S
    try:
        pending = try_environment.apply_async(args, queue=queue, expires=deadline, retry=False)
    except OperationalError as exc:
        log.warning("environment try-it: broker unreachable: %s", exc)
        raise SandboxServiceUnavailable(f"the sandbox service cannot be reached ({type(exc).__name__}): "
                                        "try again shortly") from None
    try:
        outcome = pending.get(timeout=deadline, propagate=False, disable_sync_subtasks=False)
    except ResultTimeout:
        pending.revoke()
        raise SandboxServiceUnavailable(f"the sandbox service did not answer within {deadline:g} s "
                                        f"(no worker on the '{queue}' queue?): try again shortly") from None
    finally:
        pending.forget()
    if not isinstance(outcome, dict):
        log.warning("environment try-it: the sandbox service failed: %r", outcome)
        raise SandboxServiceUnavailable(f"the sandbox service failed ({type(outcome).__name__}): try again shortly")
    return outcome
