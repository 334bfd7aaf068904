"""Runs user-written reward code in a separate process that the operating system contains.

Used by the engine's reward service and by the platform's "try it" endpoint, so user
code never runs inside the web process or the trainer. The boundary is the kernel's,
not the interpreter's: code that tears down every Python-level guard is still held.

- **bubblewrap** (``bwrap``) starts the child in fresh mount, PID, network, IPC and UTS
  namespaces: the root filesystem is an empty tmpfs holding only /usr (read-only), the
  Python installation (read-only), a minimal /dev, its own /proc, and a 16 MB tmpfs
  working folder. No /etc, /home, /root, repository, database or model files exist in
  there; no network interface but a down loopback; no other process is visible.
- **another user per sandbox**: started by root, the child drops to a uid of its own,
  leased from the pool ``FLUXRL_SANDBOX_UID_BASE`` (61000) .. + ``FLUXRL_SANDBOX_UID_COUNT``
  (64) for the sandbox's lifetime, with no capabilities and no supplementary groups
  (``setpriv``). A lease is a ``flock`` on one file per uid, so sandboxes of any process
  on this host never share a uid, and one sandbox holding its RLIMIT_NPROC cannot stop
  another's threads or start. Started by another user, a user namespace maps the leased
  uid instead (the real uid, and so the process count, is then the caller's).
- **seccomp** filters (libseccomp, through pyseccomp): no fork/vfork or process-making
  clone, no ptrace, mount, namespaces, keyrings, bpf, io_uring, perf events; sockets
  only of the AF_UNIX family; once the interpreter has started, no execve either.
- **rlimits**: address space (memory), CPU seconds, file size, open files, processes.
- a wall-clock deadline per call enforced by the parent, which kills the sandbox.
- a PEP 578 audit hook remains, only to turn a blocked call into a clear message.

Where bubblewrap cannot run (no user namespaces, no binary), starting a sandbox raises
``SandboxUnavailable`` naming what is missing. ``FLUXRL_UNSAFE_REWARD_CODE=1`` opts in
to the old interpreter-level guards only (rlimits, a network namespace if allowed, the
audit hook); the dashboard then shows a warning on every page.
"""
from __future__ import annotations

import errno
import functools
import json
import logging
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

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

# The guards every sandboxed child runs first (reward code here; environments and the Python
# tool in workers/agents): reads the first JSON line (``code``, ``exec_filter``, ``where``: the
# words naming the code in refusals), loads the exec filter and installs the audit hook.
# ``out`` is the protocol stream, ``first`` the first message.
CHILD_GUARDS = r'''
import json, os, sys, traceback
out = sys.stdout
def reply(**kw):
    out.write(json.dumps(kw) + "\n"); out.flush()
workdir = os.getcwd()
allowed_read = tuple({os.path.realpath(p) for p in sys.path if p} | {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), workdir})
import math, re, random, statistics, string, collections, functools, itertools, fractions, decimal  # preload common stdlib
BLOCK = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
         "os.kill", "os.killpg", "os.putenv", "os.unsetenv", "ctypes.", "os.chdir", "os.remove", "os.rename",
         "os.rmdir", "os.symlink", "os.link", "shutil.rmtree", "pty.spawn", "resource.setrlimit",
         "os.setuid", "os.chmod", "os.chown", "fcntl.")
# _posixsubprocess.fork_exec starts a process without any audit event; ctypes calls anything.
BLOCK_IMPORT = {"_posixsubprocess", "_ctypes", "ctypes", "_xxsubinterpreters", "_posixshmem"}
# Events whose first argument is a path that the call changes / reads (an fd was opened through "open").
PATH_WRITE = {"os.mkdir", "os.truncate", "os.utime", "os.setxattr", "os.removexattr", "os.chflags", "os.lockf"}
PATH_READ = {"os.listdir", "os.scandir", "os.getxattr", "os.listxattr"}
def real_path(path):
    return None if path is None or isinstance(path, int) else os.path.realpath(os.fsdecode(path))
def hook(event, args):
    if event.startswith(BLOCK):
        raise PermissionError(f"sandbox: {event} is not allowed in {WHERE}")
    if event == "import" and args[0] in BLOCK_IMPORT:
        raise ImportError(f"sandbox: importing {args[0]} is not allowed in {WHERE}")  # ImportError: optional imports degrade
    if event in PATH_WRITE:
        real = real_path(args[0])
        # dir_fd (args[-1] of mkdir and utime) would make a relative path land elsewhere
        if (real is not None and not real.startswith(workdir + os.sep)) or (event in ("os.mkdir", "os.utime") and args[-1] not in (None, -1)):
            raise PermissionError(f"sandbox: {event} outside the working folder is not allowed")
    if event in PATH_READ:
        real = real_path(args[0] if args else ".")
        if real is not None and not real.startswith(allowed_read):
            raise PermissionError(f"sandbox: listing {real} is not allowed")
    if event == "open":
        path, mode, flags = args
        if isinstance(path, int):
            return
        real = os.path.realpath(os.fsdecode(path))
        writing = (mode and any(c in str(mode) for c in "wax+")) or (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR))
        if writing and not real.startswith(workdir + os.sep):
            raise PermissionError(f"sandbox: writing {real} is not allowed")
        if not writing and not real.startswith(allowed_read):
            raise PermissionError(f"sandbox: reading {real} is not allowed")
        # A directory fd outside the folder would let os.open(..., dir_fd=fd) write there
        # (the "open" event does not carry dir_fd).
        if os.path.isdir(real) and real != workdir and not real.startswith(workdir + os.sep):
            raise PermissionError(f"sandbox: opening the folder {real} is not allowed")
first = json.loads(sys.stdin.readline())
code, WHERE = first["code"], first.get("where", "reward code")
if first.get("exec_filter"):
    # The second seccomp filter (no execve), loaded now that the interpreter is running.
    import ctypes
    program = ctypes.create_string_buffer(bytes.fromhex(first["exec_filter"]))
    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    fprog = SockFprog(len(program.raw) // 8, ctypes.addressof(program))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # NO_NEW_PRIVS, SECCOMP filter
        reply(ok=False, error=f"sandbox: could not load the exec filter (errno {ctypes.get_errno()})"); sys.exit(0)
    del libc, fprog, program, SockFprog
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]
    del ctypes
for name in ("mkfifo", "mknod"):  # no audit event for these: take them away
    for module in (os, sys.modules["posix"]):
        module.__dict__.pop(name, None)
sys.addaudithook(hook)
'''

# Executed by the reward child interpreter: the guards, then one JSON request per line.
_CHILD = CHILD_GUARDS + r'''
sys.stdout = sys.stderr  # user prints must not corrupt the protocol
ns = {"__name__": "reward_module"}
try:
    exec(compile(code, "<reward>", "exec"), ns)
    fn = ns.get("reward")
    if not callable(fn):
        raise TypeError("the code must define a function reward(prompt, completion, **fields)")
except BaseException as exc:
    reply(ok=False, error=f"{type(exc).__name__}: {exc}"); sys.exit(0)
reply(ok=True)
for line in sys.stdin:
    req = json.loads(line)
    try:
        value = float(fn(req["prompt"], req["completion"], **req.get("fields", {})))
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"reward must be a finite number, got {value}")
        reply(ok=True, reward=value)
    except MemoryError:
        reply(ok=False, error="MemoryError: reward code exceeded its memory limit")
    except BaseException as exc:
        tb = traceback.extract_tb(exc.__traceback__)
        where = next((f"line {f.lineno}" for f in reversed(tb) if f.filename == "<reward>"), "")
        reply(ok=False, error=f"{type(exc).__name__}: {exc}" + (f" ({where})" if where else ""))
'''


class RewardCodeError(Exception):
    """The code cannot be used at all (syntax error, no reward function, process died)."""


@dataclass
class RewardResult:
    reward: Optional[float]
    error: Optional[str] = None
    ms: float = 0.0


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
    fd = _filter_fd(found.filters[0])
    try:
        run = subprocess.run(found.argv(fd, lease.uid) + ["-c", "import os; print(os.getuid())"], pass_fds=(fd,),
                             env=CHILD_ENV, capture_output=True, text=True, timeout=30,
                             preexec_fn=lambda: _limit_child(512, 30, unsafe=False))
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


def _filter_fd(program: bytes) -> int:
    fd = os.memfd_create("fluxrl-seccomp", 0)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _limit_child(memory_mb: int, cpu_s: int, unsafe: bool) -> None:
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


class RewardSandbox:
    """One long-lived child per reward function; restarted after a timeout or crash."""

    def __init__(self, code: str, timeout_s: float = 2.0, memory_mb: int = 512, cpu_s: int = 120):
        self.code, self.timeout_s, self.memory_mb, self.cpu_s = code, timeout_s, memory_mb, cpu_s
        self._proc: Optional[subprocess.Popen] = None
        self._dir: Optional[str] = None
        self._lease: Optional[UidLease] = None  # the uid this sandbox runs as (OS boundary only)
        self._buf = b""

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        self.close()
        try:
            where = boundary()
        except SandboxUnavailable as exc:
            raise RewardCodeError(str(exc)) from None
        unsafe = where.kind != "bwrap"
        env, cwd, pass_fds = dict(CHILD_ENV), None, ()
        if unsafe:
            self._dir = tempfile.mkdtemp(prefix="fluxrl-reward-")
            env.update(HOME=self._dir, TMPDIR=self._dir)
            cwd = self._dir
        if not unsafe:
            try:
                self._lease = lease_uid()
            except SandboxUnavailable as exc:
                raise RewardCodeError(str(exc)) from None
        filter_fd = _filter_fd(where.filters[0]) if not unsafe else -1
        try:
            if not unsafe:
                pass_fds = (filter_fd,)
            self._proc = subprocess.Popen(
                where.argv(filter_fd, self._lease.uid if self._lease else SANDBOX_UID) + ["-c", _CHILD],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                cwd=cwd, env=env, close_fds=True, pass_fds=pass_fds,
                preexec_fn=lambda: _limit_child(self.memory_mb, self.cpu_s, unsafe),
            )
        except BaseException:
            self.close()
            raise
        finally:
            if filter_fd >= 0:
                os.close(filter_fd)
        self._buf = b""
        self._send({"code": self.code, "exec_filter": where.filters[1].hex()})
        reply = self._recv(max(self.timeout_s, 10.0))
        if reply is None or not reply.get("ok"):
            err = (reply or {}).get("error") or f"reward process did not start ({self._exit_text()})"
            self.close()
            raise RewardCodeError(err)

    def close(self) -> None:
        if self._proc is not None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self._proc.wait()
            for f in (self._proc.stdin, self._proc.stdout):
                try:
                    f.close()
                except Exception:
                    pass
            self._proc = None
        if self._lease is not None:  # after the wait: the uid's processes are gone (lease_uid checks too)
            self._lease.release()
            self._lease = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    # -- scoring ---------------------------------------------------------------
    def score(self, prompt: str, completion: str, fields: Optional[dict[str, Any]] = None) -> RewardResult:
        t0 = time.perf_counter()
        if self._proc is None or self._proc.poll() is not None:
            self.start()
        try:
            self._send({"prompt": prompt, "completion": completion, "fields": fields or {}})
        except (BrokenPipeError, OSError):
            reply = None
        else:
            reply = self._recv(self.timeout_s)
        ms = (time.perf_counter() - t0) * 1000
        if reply is None:
            alive = self._proc is not None and self._proc.poll() is None
            why = f"timed out after {self.timeout_s:g}s" if alive else f"reward process died ({self._exit_text()})"
            self.close()  # next call restarts a clean child
            return RewardResult(None, why, ms)
        if reply.get("ok"):
            return RewardResult(reply["reward"], None, ms)
        return RewardResult(None, reply.get("error", "unknown error"), ms)

    # -- pipe protocol ----------------------------------------------------------
    def _send(self, obj: dict) -> None:
        assert self._proc and self._proc.stdin
        self._proc.stdin.write((json.dumps(obj) + "\n").encode())
        self._proc.stdin.flush()

    def _recv(self, timeout: float) -> Optional[dict]:
        assert self._proc and self._proc.stdout
        deadline = time.monotonic() + timeout
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _exit_text(self) -> str:
        if self._proc is None:
            return "not running"
        rc = self._proc.poll()
        if rc is None:
            return "still running"
        if rc < 0:
            name = signal.Signals(-rc).name
            hint = " (CPU time limit)" if name == "SIGXCPU" else " (killed, likely its memory limit)" if name == "SIGKILL" else ""
            return f"signal {name}{hint}"
        return f"exit code {rc}"


def try_reward(code: str, rows: list[dict], timeout_s: float = 2.0, memory_mb: int = 256) -> dict:
    """Score a few rows (each {prompt, completion, fields}) for the platform's "try it".

    Returns {"ok": bool, "error": str|None, "results": [{"reward", "error", "ms"}]}.
    """
    sandbox = RewardSandbox(code, timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=max(2, int(timeout_s * len(rows)) + 2))
    try:
        sandbox.start()
    except RewardCodeError as exc:
        return {"ok": False, "error": str(exc), "results": []}
    try:
        results = [sandbox.score(r["prompt"], r["completion"], r.get("fields")).__dict__ for r in rows]
    finally:
        sandbox.close()
    return {"ok": all(r["error"] is None for r in results), "error": None, "results": results}
