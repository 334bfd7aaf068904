"""Running a run on a worker host. The Celery task (tasks.execute_run) calls
execute_run here: it starts the engine CLI (`python -m workers run SPEC ...`) as a
subprocess in its own process group, watches it until it exits, and records how it
ended. The engine reports everything else itself, over the REST API, with a run token.

    queued -> starting (here) -> running (the engine) -> succeeded (the engine, or here on exit 0)
                                                      -> failed (the engine, or here with the log's tail)
                                                      -> cancelled (here, after stopping the group)

The engine spawns vLLM and trainer processes; they share its process group, so
cancelling or cleaning up after a crash signals the whole tree at once. A run whose
watcher died (Celery worker killed, host lost) stops heart-beating; reap_stale_runs
fails it.
"""
from __future__ import annotations

import ctypes
import hashlib
import hmac
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError, close_old_connections, transaction
from django.db.models import Q
from django.utils import timezone
from workers.io.ports import free_port
from workers.rollout.tickets import TICKET_ENV, VERIFIER_ENV
from workers.spec.resolved import resolved_document

from fluxrl.accounts.services import create_run_token
from fluxrl.errors import DomainError
from fluxrl.quotas.services import pool_tenant

from .engine_inputs import resolve_spec, run_dir, run_output_dir  # the one place run folders are named
from .lifecycle import IllegalTransition, resume_from_checkpoint, transition
from .models import Run, RunStatus
from .tickets import pool_ticket, verifier_path

log = logging.getLogger(__name__)

POLL_S = 1.0
REAP_EVERY_S = 30.0
LIVE_STATUSES = (RunStatus.STARTING, RunStatus.RUNNING)
LOG_TAIL_LINES = 20
LOG_TAIL_CHARS = 3000
# Never handed to the engine: workers do not touch the database (docs/architecture.md §2), and
# the engine runs user reward code.
PRIVATE_ENV = ("DATABASE_URL", "DJANGO_SECRET_KEY", "POSTGRES_PASSWORD", "FLUXRL_CLUSTER_KEY_SECRET", "REDIS_URL",
               "FLUXRL_POOL_TICKET_KEY_FILE")
RUN_TOKEN_ENV = "FLUXRL_RUN_TOKEN"
CLUSTER_KEY_ENV = "FLUXRL_CLUSTER_KEY"  # workers/io/wire.py: the processes of a run over several nodes  # read by `python -m workers run` when --token is not given

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def engine_command(run_id: int, spec_path: Path, out_dir: Path, resume: bool = False,
                   rendezvous: str = "") -> list[str]:
    # No --token here: a command line is visible to every user of the host (ps, /proc);
    # the run token goes in the environment (start_engine). --resume: continue from the
    # newest checkpoint in out_dir (a run queued again by services.resume_run).
    return [*settings.FLUXRL_ENGINE_COMMAND, "run", str(spec_path), "--out", str(out_dir),
            "--platform", settings.FLUXRL_PUBLIC_URL, "--run-id", str(run_id), "--no-progress",
            *(["--resume"] if resume else []), *(["--rendezvous", rendezvous] if rendezvous else [])]


def node_command(rendezvous: str, node_rank: int, out_dir: Path) -> list[str]:
    # --out: the agent loads and saves trainer state only under the run's folder, the
    # platform's choice rather than whatever node 0's coordinator names.
    address = settings.FLUXRL_NODE_ADDRESS
    return [*settings.FLUXRL_ENGINE_COMMAND, "node", "--rendezvous", rendezvous, "--node-rank", str(node_rank),
            "--out", str(out_dir), *(["--host", address] if address else [])]


def cluster_key(run: Run) -> str:
    """The key a run's processes on several nodes authenticate each other with: derived
    from FLUXRL_CLUSTER_KEY_SECRET (the workers' secret, never the Django one nor on the
    data volume) and the run, so it is stored nowhere and no other run's processes hold it."""
    message = f"fluxrl-cluster:{run.pk}:{run.created_at.isoformat()}".encode()
    return hmac.new(settings.FLUXRL_CLUSTER_KEY_SECRET.encode(), message, hashlib.sha256).hexdigest()


def pool_env(run: Run) -> dict[str, str]:
    """rollout.share_engines (workers/rollout/pool.py): who the run is on a shared engine
    pool. Its tenant and weight are the records' (quotas.services.pool_tenant: an operator's
    setting, never the spec's), in a ticket the platform signs (runs/tickets.py), which the
    pool checks with the public key named here; the run's name is shown only to runs of its
    own team."""
    tenant, weight = pool_tenant(run)
    return {TICKET_ENV: pool_ticket(run.pk, tenant, weight), VERIFIER_ENV: str(verifier_path()),
            "FLUXRL_POOL_RUN": f"#{run.pk} {run.name}"[:200]}


def new_rendezvous() -> str:
    """This worker host's address (FLUXRL_NODE_ADDRESS, default loopback) and a port free
    now, outside the ephemeral range (the engine binds it seconds later)."""
    host = settings.FLUXRL_NODE_ADDRESS or "127.0.0.1"
    return f"{host}:{free_port(host)}"


def _term_with_parent() -> None:  # runs in the child, between fork and exec
    # If the watching Celery process dies, the engine gets SIGTERM (and stops its
    # children) instead of training on, unwatched and uncancellable.
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start_engine(command: list[str], log_path: Path, token: str | None, extra_env: dict | None = None) -> subprocess.Popen:
    """The engine in a new session (its own process group, pgid = pid), output to log_path,
    its run token in FLUXRL_RUN_TOKEN."""
    env = {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV} | (extra_env or {})
    if token is not None:
        env[RUN_TOKEN_ENV] = token
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            command, cwd=settings.REPO_DIR, env=env, stdin=subprocess.DEVNULL, stdout=log_file,
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_term_with_parent if _libc else None,
        )


# --- process groups -----------------------------------------------------------------------


def group_members(pgid: int) -> list[int]:
    """Pids of the live processes (zombies excluded) in a process group."""
    if not os.path.isdir("/proc"):  # not Linux: ask the kernel whether anyone is left
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()  # the command name may hold spaces
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_group_empty(proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        proc.poll()  # reap the leader, or it stays in the group as a zombie
        if not group_members(proc.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def stop_group(proc: subprocess.Popen, grace: float | None = None) -> None:
    """SIGTERM every process of the engine's group, SIGKILL what is left after the
    grace period, and return once none is left."""
    grace = settings.FLUXRL_CANCEL_GRACE_S if grace is None else grace
    if group_members(proc.pid):
        signal_group(proc.pid, signal.SIGTERM)
        if not _wait_group_empty(proc, grace):
            log.warning("engine group %s ignored SIGTERM for %.0f s: SIGKILL", proc.pid, grace)
            signal_group(proc.pid, signal.SIGKILL)
            _wait_group_empty(proc, 10)
    proc.wait()


# --- one run ------------------------------------------------------------------------------


def execute_run(run_id: int) -> str:
    """Run a queued run to its end and return its final status. A redelivered task
    (acks_late) or a run cancelled while queued finds the run no longer queued, and
    nothing is started."""
    try:
        launched = launch(run_id)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the run must not stay queued
        # Typically: the spec no longer validates, the data folder is not writable.
        log.exception("run %s: could not start the engine", run_id)
        message = exc.message if isinstance(exc, DomainError) else f"{type(exc).__name__}: {exc}"
        reason = f"Could not start the engine: {message}"
        try:
            return transition(Run(pk=run_id), RunStatus.FAILED, failure_reason=reason).status
        except IllegalTransition:  # cancelled meanwhile
            return Run.objects.get(pk=run_id).status
    if launched is None:
        return "skipped"
    proc, log_path = launched
    try:
        code = watch(run_id, proc)
    finally:
        stop_group(proc)  # the engine's children outlive it when it is killed
    return finish(run_id, code, log_path)


def launch(run_id: int) -> tuple[subprocess.Popen, Path] | None:
    """Start the engine of a queued run and move the run to starting, or None if the run
    is not queued. The row stays locked until the pid is recorded, so a cancel or the
    engine's first report waits for it."""
    folder = run_dir(run_id)
    proc = None
    try:
        with transaction.atomic():
            run = Run.objects.select_for_update().filter(pk=run_id).first()
            if run is None or run.status != RunStatus.QUEUED:
                log.info("run %s is %s: nothing to start", run_id, run.status if run else "gone")
                return None
            folder.mkdir(parents=True, exist_ok=True)
            spec_path = folder / "spec.json"
            spec_path.write_text(json.dumps(resolved_document(resolve_spec(run)), indent=2))
            _, key = create_run_token(run)
            nodes = int(run.resolved_spec.get("resources", {}).get("nodes", 1))
            rendezvous = new_rendezvous() if nodes > 1 else ""
            command = engine_command(run.pk, spec_path, run_output_dir(run.pk), resume=resume_from_checkpoint(run),
                                     rendezvous=rendezvous)
            proc = start_engine(command, folder / "engine.log", key,
                                {**pool_env(run), **({CLUSTER_KEY_ENV: cluster_key(run)} if rendezvous else {})})
            # the other nodes' join_run tasks wait for the rendezvous of a live run
            transition(run, RunStatus.STARTING, worker_host=socket.gethostname(), worker_pid=proc.pid,
                       rendezvous=rendezvous)
    except BaseException:
        if proc is not None:
            stop_group(proc, grace=0)
        raise
    log.info("run %s: engine started, pid %s", run_id, proc.pid)
    return proc, folder / "engine.log"


def watch(run_id: int, proc: subprocess.Popen, heartbeat: bool = True) -> int | None:
    """Wait for the engine to exit, heart-beating and checking the cancel flag about
    once a second (and reaping other runs now and then). Returns its exit code, or
    None if it was stopped for a cancel. A node agent's watcher (``heartbeat=False``)
    leaves the run's heartbeat and the reaping to node 0's."""
    next_beat = next_reap = 0.0
    ended_at = None  # when the run turned terminal while the engine was still up
    while True:
        try:
            return proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            close_old_connections()  # hours-long task: drop connections the server closed
            row = Run.objects.filter(pk=run_id).values_list("status", "cancel_requested").first()
            db_contact.succeeded()
            if heartbeat and time.monotonic() >= next_beat:
                Run.objects.filter(pk=run_id, status__in=LIVE_STATUSES).update(heartbeat_at=timezone.now())
                next_beat = time.monotonic() + settings.FLUXRL_HEARTBEAT_S
            if heartbeat and time.monotonic() >= next_reap:
                # A worker busy with runs takes no beat task (one slot per run): it reaps here.
                reap_stale_runs()
                next_reap = time.monotonic() + REAP_EVERY_S
        except DatabaseError as exc:
            db_contact.failed(exc)  # the reapers of this process wait for a full window after it
            log.warning("run %s: database unavailable, watching on", run_id, exc_info=True)
            continue
        if row is None or row[1]:
            log.info("run %s: %s, stopping the engine", run_id, "cancel requested" if row else "deleted")
            stop_group(proc)
            return None
        if row[0] not in LIVE_STATUSES:
            # Reported finished (or failed by the reaper) but still up: give it the grace period.
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at > settings.FLUXRL_CANCEL_GRACE_S:
                stop_group(proc)
                return proc.returncode


def join_run(run_id: int, node_rank: int) -> str:
    """Node ``node_rank`` of a run over several nodes: wait until node 0 has started the
    run's coordinator, then run this host's node agent and watch it. An agent that fails
    fails the run (the coordinator fails it too, having lost the node); a run that ends
    or is cancelled stops the agent."""
    deadline = time.monotonic() + settings.FLUXRL_JOIN_TIMEOUT_S
    while True:
        close_old_connections()
        run = Run.objects.filter(pk=run_id).first()
        if run is None or run.is_terminal or run.cancel_requested:
            return "skipped"
        if run.rendezvous and run.status in LIVE_STATUSES:
            break
        if time.monotonic() > deadline:
            _fail_live(run_id, f"Node {node_rank} found no coordinator to join within "
                               f"{settings.FLUXRL_JOIN_TIMEOUT_S:.0f} s (node 0's task did not start).")
            return "failed"
        time.sleep(POLL_S)
    folder = run_dir(run_id)
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / f"node-{node_rank}.log"
    proc = start_engine(node_command(run.rendezvous, node_rank, run_output_dir(run_id)), log_path, None, {CLUSTER_KEY_ENV: cluster_key(run)})
    log.info("run %s: node %d agent started, pid %s", run_id, node_rank, proc.pid)
    try:
        code = watch(run_id, proc, heartbeat=False)
    finally:
        stop_group(proc)
    if code and _fail_live(run_id, failure_reason(code, log_path, f"Node {node_rank}'s agent")):
        return "failed"
    return "done"


def _fail_live(run_id: int, reason: str) -> bool:
    """Fail the run unless it has ended already; whether it was this that failed it."""
    with transaction.atomic():
        run = Run.objects.select_for_update().filter(pk=run_id).first()
        if run is None or run.is_terminal:
            return False
        try:
            transition(run, RunStatus.FAILED, failure_reason=reason)
        except IllegalTransition:
            return False
        return True


def log_tail(path: Path, lines: int = LOG_TAIL_LINES, max_chars: int = LOG_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    # Progress bars rewrite their line with \r: keep what was shown last.
    shown = [line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n")]
    return "\n".join([line for line in shown if line][-lines:])[-max_chars:]


def failure_reason(code: int, log_path: Path, who: str = "The engine") -> str:
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    tail = log_tail(log_path)
    return f"{who} {how}." + (f" Last lines of its log:\n{tail}" if tail else "")


def finish(run_id: int, code: int | None, log_path: Path) -> str:
    """Record how the engine ended unless it did so itself: cancelled (code None),
    succeeded (exit 0) or failed with the last lines of its log."""
    close_old_connections()
    run = Run.objects.filter(pk=run_id).first()
    if run is None:
        return "gone"
    if run.is_terminal:
        if run.status == RunStatus.FAILED and not run.failure_reason and code:
            # The engine reported the failure without saying why: its log says.
            Run.objects.filter(pk=run_id, failure_reason="").update(failure_reason=failure_reason(code, log_path))
        return run.status
    if code is None:
        status, reason = RunStatus.CANCELLED, ""
    elif code == 0:
        status, reason = RunStatus.SUCCEEDED, ""
        if run.status == RunStatus.STARTING:  # an engine that never reported
            run = transition(run, RunStatus.RUNNING)
    else:
        status, reason = RunStatus.FAILED, failure_reason(code, log_path)
    try:
        return transition(run, status, failure_reason=reason).status
    except IllegalTransition:  # it finished in the meantime
        run.refresh_from_db()
        return run.status


# --- runs nobody watches any more -----------------------------------------------------------


class DatabaseContact:
    """This process's own record of reaching the database: since when it has had contact
    (its first success, or its first success after the last loss). While the database is
    away nobody can write a heartbeat, so a heartbeat can only be judged stale over a
    window in which this process itself could have seen it arrive: the reaper waits until
    its contact has lasted FLUXRL_RUN_STALE_S. A process that has not seen the database
    for a window yet — a worker started just after an outage that other workers' watchers
    are still recovering from — does not reap (Celery processes observe it from their
    start: keep_contact)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._lost_at: float | None = None  # monotonic; None: not lost (as far as we know)
        self._since: float | None = None  # monotonic, first success (after the last loss); None: none yet

    def failed(self, exc: BaseException | None = None) -> None:
        """The database could not be reached (a query's own error, such as a constraint, is
        no loss of contact)."""
        if exc is not None and not isinstance(exc, (OperationalError, InterfaceError)):
            return
        with self._lock:
            if self._lost_at is None:
                self._lost_at, self._since = time.monotonic(), None

    def succeeded(self) -> None:
        with self._lock:
            now = time.monotonic()
            if self._lost_at is not None:
                log.warning("database reachable again after %.1f s", now - self._lost_at)
                self._lost_at = None
            if self._since is None:
                self._since = now

    def unbroken_s(self) -> float:
        """Seconds of unbroken contact: since the first success of this process, or since
        the return after its last loss; 0 while lost or before any success."""
        with self._lock:
            if self._lost_at is not None or self._since is None:
                return 0.0
            return time.monotonic() - self._since

    def assume_contact_for(self, seconds: float) -> None:
        """Record that this process has been in contact for ``seconds`` already (tests and
        tools that call the reaper directly in a process whose contact they vouch for)."""
        with self._lock:
            self._lost_at, self._since = None, time.monotonic() - seconds

    def _after_fork(self) -> None:
        # a child forked while another thread held the lock would wait on it forever
        self._lock = threading.Lock()


db_contact = DatabaseContact()
os.register_at_fork(after_in_child=lambda: db_contact._after_fork())  # noqa: SLF001
_keeper_pid: int | None = None


def contact_every_s() -> float:
    """How often keep_contact looks: several times a stale window."""
    return max(0.1, min(settings.FLUXRL_HEARTBEAT_S, settings.FLUXRL_RUN_STALE_S / 4))


def contact_short_of_window_s() -> float:
    """How long this process must still keep contact before its reaper may reap (0: it may)."""
    return max(0.0, settings.FLUXRL_RUN_STALE_S - db_contact.unbroken_s())


def check_contact() -> bool:
    """One look at the database (its own connection in a thread), recorded in db_contact."""
    from django.db import connection

    try:
        close_old_connections()
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except DatabaseError as exc:
        db_contact.failed(exc)
        try:
            connection.close()  # a broken connection: a fresh one next time
        except DatabaseError:
            pass
        return False
    db_contact.succeeded()
    return True


def keep_contact() -> bool:
    """Watch the database from this process (once per process: a daemon thread looking every
    contact_every_s), so that its reaper knows whether the database was there over the last
    window: an idle Celery process (beat's reap task lands on any prefork child) sees an
    outage it had no task during, and a new one can reap a window after its start.
    Whether a thread was started."""
    global _keeper_pid
    if _keeper_pid == os.getpid():
        return False
    _keeper_pid = os.getpid()

    def look():
        while True:
            check_contact()
            time.sleep(contact_every_s())

    threading.Thread(target=look, name="fluxrl-db-contact", daemon=True).start()
    return True


def reap_stale_runs() -> list[int]:
    """Fail the starting/running runs whose heartbeat is older than FLUXRL_RUN_STALE_S:
    the Celery worker that watched them died, so they would never end otherwise.
    Returns their ids. Nothing is reaped until this process has reached the database
    without a break for FLUXRL_RUN_STALE_S (db_contact): after an outage every heartbeat
    is old, and the watchers that missed theirs get a full window to beat again."""
    stale_s = settings.FLUXRL_RUN_STALE_S
    cutoff = timezone.now() - timedelta(seconds=stale_s)
    stale = Q(status__in=LIVE_STATUSES) & (Q(heartbeat_at__lt=cutoff) | Q(heartbeat_at__isnull=True, updated_at__lt=cutoff))
    try:
        candidates = list(Run.objects.filter(stale).values_list("pk", flat=True))
    except DatabaseError as exc:
        db_contact.failed(exc)
        raise
    db_contact.succeeded()
    contact_s = db_contact.unbroken_s()
    if candidates and contact_s < stale_s:
        log.warning("not reaping runs %s yet: the database has been reachable for only %.1f s of the %.0f s "
                    "a heartbeat gets (FLUXRL_RUN_STALE_S)", candidates, contact_s, stale_s)
        return []
    reaped = []
    for run_id in candidates:
        with transaction.atomic():
            run = Run.objects.select_for_update().filter(stale, pk=run_id).first()  # still stale under the lock?
            if run is None:
                continue
            where = f"{run.worker_host or 'an unknown host'}, pid {run.worker_pid}"
            transition(run, RunStatus.FAILED, failure_reason=(
                f"Lost: no heartbeat for more than {stale_s:.0f} s from the worker watching the engine ({where}); "
                "its Celery worker stopped or the host went down."))
        log.warning("run %s: no heartbeat since %s, marked failed", run_id, run.heartbeat_at)
        reaped.append(run_id)
    return reaped
