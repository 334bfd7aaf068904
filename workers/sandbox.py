"""Runs user-written reward code in a separate, resource-limited process.

Used by the engine's reward service and by the platform's "try it" endpoint, so user
code never runs inside the web process or the trainer. Layers, each catching what the
others miss:
- a fresh interpreter (``python -I``) with an empty environment (no platform secrets),
  its own empty working folder and its own process group;
- rlimits: address space (memory), CPU seconds, file size, open files;
- a private network namespace where the OS allows it (no interface but a down loopback);
- a PEP 578 audit hook that refuses sockets, subprocesses, fork/exec, signals, ctypes,
  environment changes, writes outside the working folder and reads outside the Python
  installation and the working folder;
- a wall-clock deadline per call enforced by the parent, which kills the process group.
"""
from __future__ import annotations

import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Optional

# Executed by the child interpreter. Reads the code, then one JSON request per line.
_CHILD = r'''
import json, os, sys, traceback
out = sys.stdout
sys.stdout = sys.stderr  # user prints must not corrupt the protocol
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
        raise PermissionError(f"sandbox: {event} is not allowed in reward code")
    if event == "import" and args[0] in BLOCK_IMPORT:
        raise ImportError(f"sandbox: importing {args[0]} is not allowed in reward code")  # ImportError: optional imports degrade
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
code = json.loads(sys.stdin.readline())["code"]
for name in ("mkfifo", "mknod"):  # no audit event for these: take them away
    for module in (os, sys.modules["posix"]):
        module.__dict__.pop(name, None)
sys.addaudithook(hook)
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


def _limit_child(memory_mb: int, cpu_s: int) -> None:
    # Runs in the child between fork and exec.
    os.setsid()
    mem = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:  # a network namespace of its own: no way out even past the audit hook
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
        self._buf = b""

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        self.close()
        self._dir = tempfile.mkdtemp(prefix="fluxrl-reward-")
        env = {"PATH": "/usr/bin:/bin", "HOME": self._dir, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _CHILD],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            cwd=self._dir, env=env, close_fds=True,
            preexec_fn=lambda: _limit_child(self.memory_mb, self.cpu_s),
        )
        self._buf = b""
        self._send({"code": self.code})
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
