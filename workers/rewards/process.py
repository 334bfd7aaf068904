"""A child process inside the reward sandbox's operating-system boundary, for any program.

The boundary is workers/rewards/sandbox_boundary.py's: bubblewrap namespaces, a uid leased from the
pool, the seccomp filters (no fork, no execve once Python runs), rlimits, and the audit
hook of ``CHILD_GUARDS``, which every program here runs first. What differs between users
is the program after the guards and how its output is read: the agents' environments
(workers/agents/sandboxed.py) speak JSON lines with a long-lived child, the Python tool
(workers/agents/tools.py) starts one child per call and reads everything it prints.
Reading is always bounded twice: by a wall-clock deadline and by a byte count.
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
from typing import Optional

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


class ChildTimeout(Exception):
    """No (complete) answer before the deadline."""


class ChildFlood(Exception):
    """The child wrote more than the byte cap allows."""


class ChildDied(Exception):
    """The child exited (or closed its output) without answering."""


class SandboxedChild:
    """One child interpreter in the boundary running ``CHILD_GUARDS`` + ``program``.

    ``start(first)`` sends ``first`` (with the exec filter added) as the first JSON line.
    ``merge_stderr`` sends the child's stderr to the same pipe as stdout (a one-shot program
    whose whole output is the result); otherwise stderr is discarded."""

    def __init__(self, program: str, *, memory_mb: int, cpu_s: int, merge_stderr: bool = False):
        self.program, self.memory_mb, self.cpu_s, self.merge_stderr = program, memory_mb, cpu_s, merge_stderr
        self.proc: Optional[subprocess.Popen] = None
        self._dir: Optional[str] = None
        self._lease: Optional[UidLease] = None
        self._buf = b""

    @property
    def uid(self) -> Optional[int]:
        """The uid leased for the child (None without the OS boundary)."""
        return self._lease.uid if self._lease is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, first: dict) -> None:
        """Start the child; raises SandboxUnavailable when the boundary cannot be set up."""
        self.close()
        where = boundary()
        unsafe = where.kind != "bwrap"
        env, cwd, pass_fds = dict(CHILD_ENV), None, ()
        if unsafe:
            self._dir = tempfile.mkdtemp(prefix="fluxrl-agent-")
            env.update(HOME=self._dir, TMPDIR=self._dir)
            cwd = self._dir
        else:
            self._lease = lease_uid()
        filter_fd = seccomp_fd(where.filters[0]) if not unsafe else -1
        try:
            if not unsafe:
                pass_fds = (filter_fd,)
            memory_mb, cpu_s = self.memory_mb, self.cpu_s
            self.proc = subprocess.Popen(
                # -u: what a killed child printed before its deadline still arrives
                where.argv(filter_fd, self._lease.uid if self._lease else SANDBOX_UID) + ["-u", "-c", CHILD_GUARDS + self.program],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT if self.merge_stderr else subprocess.DEVNULL,
                cwd=cwd, env=env, close_fds=True, pass_fds=pass_fds,
                preexec_fn=lambda: limit_child(memory_mb, cpu_s, unsafe),
            )
        except BaseException:
            self.close()
            raise
        finally:
            if filter_fd >= 0:
                os.close(filter_fd)
        self._buf = b""
        self.send({**first, "exec_filter": where.filters[1].hex()})

    def send(self, obj: dict) -> None:
        """Write one JSON line; ChildDied when the child is gone."""
        if self.proc is None or self.proc.stdin is None:
            raise ChildDied("not running")
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise ChildDied(self.exit_text()) from None

    def end_input(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def recv(self, timeout_s: float, max_bytes: int) -> dict:
        """The next JSON line. ChildTimeout, ChildFlood (a line over ``max_bytes``), ChildDied."""
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            if len(self._buf) > max_bytes:
                raise ChildFlood(f"over {max_bytes} bytes")
            self._buf += self._read(deadline, max_bytes + 1 - len(self._buf))
        line, self._buf = self._buf.split(b"\n", 1)
        if len(line) > max_bytes:
            raise ChildFlood(f"over {max_bytes} bytes")
        try:
            return json.loads(line)
        except ValueError:
            raise ChildDied(f"wrote something that is not the protocol: {line[:80]!r}") from None

    def read_all(self, timeout_s: float, max_bytes: int) -> tuple[bytes, Optional[str]]:
        """Everything the child writes until it exits: (bytes, None), or what arrived and
        "timeout" / "output_limit" (the child is killed then)."""
        assert self.proc is not None and self.proc.stdout is not None
        deadline, data = time.monotonic() + timeout_s, bytearray()
        try:
            while True:
                chunk = self._read(deadline, max_bytes + 1 - len(data))
                data += chunk
                if len(data) > max_bytes:
                    self.kill()
                    return bytes(data[:max_bytes]), "output_limit"
        except ChildTimeout:
            self.kill()
            return bytes(data), "timeout"
        except ChildDied:  # end of output: the child exited
            return bytes(data), None

    def _read(self, deadline: float, limit: int) -> bytes:
        fd = self.proc.stdout.fileno()
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChildTimeout()
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            raise ChildTimeout()
        chunk = os.read(fd, max(1, min(65536, limit)))
        if not chunk:
            raise ChildDied(self.exit_text())
        return chunk

    def wait(self, timeout_s: float = 5.0) -> Optional[int]:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()

    def close(self) -> None:
        if self.proc is not None:
            self.kill()
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    if f is not None:
                        f.close()
                except Exception:
                    pass
            self.proc = None
        if self._lease is not None:  # after the wait: the uid's processes are gone
            self._lease.release()
            self._lease = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def exit_text(self) -> str:
        if self.proc is None:
            return "not running"
        rc = self.proc.poll()
        if rc is None:
            return "still running"
        if rc < 0:
            name = signal.Signals(-rc).name
            hint = " (CPU time limit)" if name == "SIGXCPU" else " (killed, likely its memory limit)" if name == "SIGKILL" else ""
            return f"signal {name}{hint}"
        return f"exit code {rc}"


__all__ = ["CHILD_GUARDS", "ChildDied", "ChildFlood", "ChildTimeout", "SandboxUnavailable", "SandboxedChild"]
