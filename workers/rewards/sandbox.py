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

import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Optional

from workers.rewards.sandbox_boundary import (CHILD_ENV, SANDBOX_UID, SandboxUnavailable, UidLease, boundary, lease_uid,
                                              limit_child, seccomp_fd)

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
        filter_fd = seccomp_fd(where.filters[0]) if not unsafe else -1
        try:
            if not unsafe:
                pass_fds = (filter_fd,)
            self._proc = subprocess.Popen(
                where.argv(filter_fd, self._lease.uid if self._lease else SANDBOX_UID) + ["-c", _CHILD],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                cwd=cwd, env=env, close_fds=True, pass_fds=pass_fds,
                preexec_fn=lambda: limit_child(self.memory_mb, self.cpu_s, unsafe),
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
