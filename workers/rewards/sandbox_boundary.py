"""The operating-system boundary of a sandboxed child (workers/rewards/sandbox.py): the
seccomp filters, the pool of sandbox uids (leased one per child), bubblewrap's command line,
whether this machine can set it all up (``boundary``, ``sandbox_status``), and the rlimits
a child starts under. Shared by the reward sandbox and the agents' environments and tools
(workers/rewards/process.py)."""
from __future__ import annotations

import errno
import functools
import logging
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

logger = logging.getLogger(__name__)

UNSAFE_ENV = "FLUXRL_UNSAFE_REWARD_CODE"
UID_BASE_ENV, UID_COUNT_ENV, UID_LOCK_DIR_ENV = "FLUXRL_SANDBOX_UID_BASE", "FLUXRL_SANDBOX_UID_COUNT", "FLUXRL_SANDBOX_LOCK_DIR"
# The pool's first uid (FLUXRL_SANDBOX_UID: its former, single-uid name).
SANDBOX_UID = int(os.environ.get(UID_BASE_ENV) or os.environ.get("FLUXRL_SANDBOX_UID") or 61000)
UID_WAIT_S = 10.0  # how long a sandbox waits for a free uid when every one is leased
STATUS_TTL_S = 30.0  # how long sandbox_status() reuses a failed probe (a proven boundary is kept)
WORKDIR_MB = 16
MAX_PROCESSES = 64  # RLIMIT_NPROC of the sandbox user: threads count too
CHILD_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/work", "LANG": "C.UTF-8",
             "PYTHONDONTWRITEBYTECODE": "1"}


class SandboxUnavailable(RuntimeError):
    """The operating-system boundary cannot be set up on this machine."""



# -- the system-call filters ------------------------------------------------------
CLONE_THREAD = 0x00010000
# Calls reward code has no use for and an escape would: refused with EPERM.
_DENIED = ("fork", "vfork", "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root",
           "chroot", "unshare", "setns", "bpf", "io_uring_setup", "io_uring_enter", "io_uring_register",
           "keyctl", "add_key", "request_key", "perf_event_open", "userfaultfd", "kexec_load",
           "kexec_file_load", "init_module", "finit_module", "delete_module", "open_by_handle_at",
           "name_to_handle_at", "move_mount", "open_tree", "fsopen", "fsmount", "fspick", "mount_setattr",
           "swapon", "swapoff", "reboot", "syslog", "acct", "quotactl", "lookup_dcookie", "personality",
           "mknod", "mknodat", "pidfd_getfd", "kcmp", "setdomainname", "sethostname")
AF_UNIX = 1


def _seccomp_filters() -> tuple[bytes, bytes]:
    """BPF programs: (the sandbox's filter, loaded by bwrap; the exec filter, loaded by the
    child once Python runs). Built with libseccomp for the machine's own architecture."""
    import pyseccomp as seccomp

    def rule(filt, action, name, *args):
        try:
            filt.add_rule(action, name, *args)
        except (OSError, ValueError, RuntimeError):  # a call this architecture does not have
            pass

    main = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in _DENIED:
        rule(main, seccomp.ERRNO(errno.EPERM), name)
    # Threads yes (the interpreter and libraries start them), processes no.
    rule(main, seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))
    rule(main, seccomp.ERRNO(errno.ENOSYS), "clone3")  # flags live in memory; libc falls back to clone
    rule(main, seccomp.ERRNO(errno.EAFNOSUPPORT), "socket", seccomp.Arg(0, seccomp.NE, AF_UNIX))
    exec_only = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in ("execve", "execveat"):
        rule(exec_only, seccomp.ERRNO(errno.EPERM), name)
    return _bpf(main), _bpf(exec_only)


def _bpf(filt) -> bytes:
    with tempfile.TemporaryFile() as f:
        filt.export_bpf(f)
        f.seek(0)
        return f.read()


# -- the uid pool ------------------------------------------------------------------
def uid_pool() -> range:
    """The uids sandboxes run as (read at each lease, so a test or operator may change them)."""
    try:
        base = int(os.environ.get(UID_BASE_ENV) or os.environ.get("FLUXRL_SANDBOX_UID") or 61000)
        count = int(os.environ.get(UID_COUNT_ENV) or 64)
    except ValueError as exc:
        raise SandboxUnavailable(f"{UID_BASE_ENV} and {UID_COUNT_ENV} must be whole numbers ({exc})") from None
    if base <= 0 or count < 1:
        raise SandboxUnavailable(f"{UID_BASE_ENV} must be > 0 and {UID_COUNT_ENV} >= 1 (got {base}, {count})")
    return range(base, base + count)


def _lock_dir() -> str:
    """Where the per-uid lock files live: one folder for every process of this host that
    starts sandboxes (/run survives no reboot, which is right for locks; not /tmp, which
    systemd's PrivateTmp gives each service a copy of)."""
    folder = os.environ.get(UID_LOCK_DIR_ENV) or (
        "/run/fluxrl-sandbox" if os.geteuid() == 0 and os.access("/run", os.W_OK)
        else os.path.join(tempfile.gettempdir(), f"fluxrl-sandbox-{os.geteuid()}"))
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        owner = os.stat(folder).st_uid
    except OSError as exc:
        raise SandboxUnavailable(f"cannot make the sandbox lock folder {folder} ({exc}); set {UID_LOCK_DIR_ENV}") from None
    if owner != os.geteuid():  # another user's folder could hold every lock
        raise SandboxUnavailable(f"the sandbox lock folder {folder} belongs to another user; set {UID_LOCK_DIR_ENV}")
    return folder


def _uids_with_processes() -> set[int]:
    """Real uids of the host's live processes (a released uid whose killed sandbox is still
    being torn down must not be leased again: its tasks would count against the next one)."""
    uids = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fd = os.open(f"/proc/{name}/status", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    head = os.read(fd, 4096)
                finally:
                    os.close(fd)
                uids.add(int(head.split(b"\nUid:", 1)[1].split()[0]))
            except (OSError, ValueError, IndexError):  # exited meanwhile
                pass
    return uids


class UidLease:
    """One uid of the pool, held (an exclusive flock on its lock file) until released."""

    def __init__(self, uid: int, fd: int):
        self.uid, self._fd = uid, fd

    def release(self) -> None:
        if self._fd >= 0:
            try:
                os.utime(self._fd)  # the most recently used uid is leased last
            except OSError:
                pass
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = -1

    def __del__(self):
        self.release()


def lease_uid(wait_s: Optional[float] = None) -> UidLease:
    """Lease a uid no other sandbox on this host holds, least recently used first; wait up
    to ``wait_s`` (UID_WAIT_S) for one while every uid of the pool is taken."""
    import fcntl

    pool, folder = uid_pool(), _lock_dir()
    deadline = time.monotonic() + (UID_WAIT_S if wait_s is None else wait_s)
    while True:
        busy = _uids_with_processes()
        paths = {uid: os.path.join(folder, f"uid-{uid}.lock") for uid in pool}

        def last_used(uid: int) -> float:
            try:
                return os.stat(paths[uid]).st_mtime
            except FileNotFoundError:
                return 0.0

        for uid in sorted((u for u in pool if u not in busy), key=last_used):
            fd = os.open(paths[uid], os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return UidLease(uid, fd)
        if time.monotonic() >= deadline:
            raise SandboxUnavailable(
                f"all {len(pool)} sandbox uids ({pool.start}-{pool.stop - 1}) are in use on this host: "
                f"too many reward sandboxes at once; raise {UID_COUNT_ENV}")
        time.sleep(0.05)


# -- the boundary ------------------------------------------------------------------
@dataclass
class Boundary:
    """How sandboxes start on this machine: ``bwrap`` (the OS boundary) or ``unsafe``."""

    kind: str
    bwrap: str = ""
    setpriv: str = ""
    python: str = ""
    python_home: str = ""
    filters: tuple[bytes, bytes] = (b"", b"")
    notes: list[str] = field(default_factory=list)

    def argv(self, filter_fd: int, uid: int = SANDBOX_UID) -> list[str]:
        """The command that starts ``python -I`` inside the boundary (seccomp from ``filter_fd``) as ``uid``."""
        if self.kind != "bwrap":
            return [sys.executable, "-I"]
        a = [self.bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
             "--die-with-parent", "--new-session", "--hostname", "sandbox",
             "--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                a += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                a += ["--ro-bind", top, top]
        if os.path.exists("/etc/ld.so.cache"):
            a += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        if not self.python_home.startswith("/usr/"):
            # Parents made as fresh world-readable folders: the host's (e.g. /root, 0700) stay shut.
            parent, parents = os.path.dirname(self.python_home), []
            while parent not in ("/", ""):
                parents.append(parent)
                parent = os.path.dirname(parent)
            for folder in reversed(parents):
                a += ["--perms", "0755", "--dir", folder]
            a += ["--ro-bind", self.python_home, self.python_home]
        a += ["--proc", "/proc", "--dev", "/dev",
              "--perms", "1777", "--size", str(WORKDIR_MB << 20), "--tmpfs", "/work", "--chdir", "/work",
              "--seccomp", str(filter_fd)]
        if self.setpriv:
            a += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--", self.setpriv,
                  f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                  "--inh-caps=-all", "--bounding-set=-all", "--"]
        else:
            a += ["--unshare-user", "--uid", str(uid), "--gid", str(uid), "--"]
        return a + [self.python, "-I"]


def _python_install() -> tuple[str, str]:
    """The real interpreter binary (past a virtualenv's symlink) and its installation root."""
    python = os.path.realpath(sys.executable)
    home = os.path.realpath(sys.base_prefix)
    if not python.startswith(home + os.sep):
        home = os.path.dirname(os.path.dirname(python))
    return python, home


@functools.lru_cache(maxsize=1)
def boundary() -> Boundary:
    """Find (once per process) how to contain reward code here, proving it by starting one
    sandbox; raise ``SandboxUnavailable`` naming what is missing, unless the operator has
    opted in to the unsafe path with FLUXRL_UNSAFE_REWARD_CODE=1."""
    problems: list[str] = []
    bwrap = shutil.which("bwrap") or ""
    setpriv = shutil.which("setpriv") or ""
    if not bwrap:
        problems.append("bubblewrap is not installed (apt-get install bubblewrap)")
    if os.geteuid() == 0 and not setpriv:
        problems.append("setpriv is not installed (apt-get install util-linux)")
    filters = (b"", b"")
    try:
        filters = _seccomp_filters()
    except Exception as exc:  # ImportError, or libseccomp missing
        problems.append(f"no seccomp filter ({type(exc).__name__}: {exc}; pip install pyseccomp, apt-get install libseccomp2)")
    python, home = _python_install()
    if not problems:
        found = Boundary("bwrap", bwrap, setpriv if os.geteuid() == 0 else "", python, home, filters)
        problem = _probe(found)
        if problem is None:
            return found
        problems.append(problem)
    if os.environ.get(UNSAFE_ENV) == "1":
        logger.warning("reward code runs WITHOUT the operating-system sandbox (%s=1): %s", UNSAFE_ENV, "; ".join(problems))
        return Boundary("unsafe", python=python, python_home=home, notes=problems)
    raise SandboxUnavailable(
        "reward code cannot be contained on this machine: " + "; ".join(problems)
        + f". Fix that, or set {UNSAFE_ENV}=1 to run reward code with interpreter-level guards only (not a security boundary).")


_status: tuple[float, tuple[bool, str]] = (0.0, (False, ""))
_status_lock = threading.Lock()


def sandbox_status(max_age_s: float = STATUS_TTL_S) -> tuple[bool, str]:
    """(available, reason): whether reward code can be contained here, proven by starting a
    real sandbox (``boundary()``), and the reason in words. A failure is re-probed after
    ``max_age_s`` (someone may install bubblewrap meanwhile); a proven boundary stays proven
    for the life of the process, as ``boundary()`` keeps it."""
    global _status
    with _status_lock:
        checked_at, state = _status
        if checked_at and time.monotonic() - checked_at < max_age_s:
            return state
        try:
            here = boundary()
        except SandboxUnavailable as exc:
            state = (False, str(exc))
        else:
            if here.kind == "bwrap":
                pool = uid_pool()
                state = (True, f"proven: a contained probe ran in bubblewrap (namespaces, seccomp, rlimits) "
                               f"as a uid of the pool {pool.start}-{pool.stop - 1}")
            else:
                state = (False, f"reward code runs WITHOUT the operating-system sandbox ({UNSAFE_ENV}=1): "
                                + "; ".join(here.notes))
        _status = (time.monotonic(), state)
        return state


def forget_status() -> None:
    """Probe afresh at the next ``sandbox_status()`` (after PATH or the environment changed)."""
    global _status
    with _status_lock:
        _status = (0.0, (False, ""))
        boundary.cache_clear()


def _probe(found: Boundary) -> Optional[str]:
    try:
        lease = lease_uid()
    except SandboxUnavailable as exc:
        return str(exc)
    fd = seccomp_fd(found.filters[0])
    try:
        run = subprocess.run(found.argv(fd, lease.uid) + ["-c", "import os; print(os.getuid())"], pass_fds=(fd,),
                             env=CHILD_ENV, capture_output=True, text=True, timeout=30,
                             preexec_fn=lambda: limit_child(512, 30, unsafe=False))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap did not start ({exc})"
    finally:
        os.close(fd)
        lease.release()
    if run.returncode != 0 or run.stdout.strip() != str(lease.uid):
        err = (run.stderr.strip().splitlines() or ["no output"])[-1]
        return (f"bubblewrap could not start a sandbox ({err}); user namespaces may be disabled "
                "(sysctl kernel.unprivileged_userns_clone / user.max_user_namespaces) or, in a container, "
                "it needs CAP_SYS_ADMIN and an unconfined AppArmor profile")
    return None


def seccomp_fd(program: bytes) -> int:
    fd = os.memfd_create("fluxrl-seccomp", 0)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def limit_child(memory_mb: int, cpu_s: int, unsafe: bool) -> None:
    # Runs in the child between fork and exec; bwrap and the interpreter inherit the limits.
    os.setsid()
    mem = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (MAX_PROCESSES, MAX_PROCESSES))
    if unsafe:
        try:  # a network namespace of its own where the OS allows it
            import ctypes

            ctypes.CDLL(None, use_errno=True).unshare(0x40000000)  # CLONE_NEWNET
        except Exception:
            pass
