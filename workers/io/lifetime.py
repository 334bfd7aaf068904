"""A child process that must not outlive the process that started it.

Trainer ranks, pipeline stages and engine servers are started by the run's engine (or a
node agent) and serve only it. When it is SIGKILLed it cannot stop them, and a child
blocked in a collective, in ``accept`` or in a long import never notices on its own: it
would live on, holding cores, memory and ports. The watch notices the reparenting
(``getppid`` changes) and ends the process.

Polling ``getppid`` rather than ``PR_SET_PDEATHSIG``: the death signal follows the
*thread* that forked, and the engine starts children from worker threads that end
while the engine lives.

The parent's pid comes from the launcher (``launcher_env``), not from ``getppid`` when the
watch starts: a child spends seconds importing before it gets there, and a launcher
SIGKILLed meanwhile would leave it reparented already, its watch waiting for a change
that has happened."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Optional

log = logging.getLogger(__name__)

POLL_S = 0.5  # how long an orphan may live on, at most (about)
LAUNCHER_ENV = "FLUXRL_LAUNCHER_PID"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts: it may not be signalled, but it is there)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_namespace() -> int:
    """This process's PID namespace (the inode of /proc/self/ns/pid; 0 where there is none to
    read). Containers that share a folder such as /tmp see each other's processes under other
    pids, or not at all: a pid is only meaningful beside its namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def file_view() -> str:
    """Which files a path names here: this boot of this host (its boot id), this mount
    namespace and this user; "" where unreadable. Two processes with the same non-empty
    view open the same file by the same path."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            boot = fh.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/mnt').st_ino}:{os.getuid()}"
    except OSError:
        return ""


def launcher_env() -> dict[str, str]:
    """What a launcher adds to the environment of a child that calls ``exit_with_parent``."""
    return {LAUNCHER_ENV: str(os.getpid())}


def exit_with_parent(parent_pid: Optional[int] = None, code: int = 70, whole_session: bool = False) -> None:
    """Exit with ``code`` within ``POLL_S`` of the parent's end, from a daemon thread.
    The parent: ``parent_pid``, else the launcher's pid from ``launcher_env`` (taken out of
    the environment, so this process's own children do not see it), else ``getppid()``.
    ``whole_session``: first SIGKILL this process's session, when it leads one (what it
    started, such as vLLM's engine core, goes with it)."""
    launcher = os.environ.pop(LAUNCHER_ENV, "")
    if parent_pid is None:
        parent_pid = int(launcher) if launcher.isdigit() else os.getppid()

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(POLL_S)
        log.warning("pid %d: its parent %d is gone: exiting", os.getpid(), parent_pid)
        if whole_session and os.getsid(0) == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)  # this process too
        os._exit(code)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
