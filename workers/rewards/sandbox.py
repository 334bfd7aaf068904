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

import time
from dataclasses import dataclass
from typing import Any, Optional

from workers.rewards.process import ChildDied, ChildFlood, ChildTimeout, SandboxedChild
from workers.rewards.sandbox_boundary import SandboxUnavailable

# Executed by the reward child interpreter after the guards (process.py): one JSON request per line.
_CHILD = r'''
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

    REPLY_BYTES = 1 << 20  # a reward reply is a number or an error message: a longer line is not the protocol

    def __init__(self, code: str, timeout_s: float = 2.0, memory_mb: int = 512, cpu_s: int = 120):
        self.code, self.timeout_s, self.memory_mb, self.cpu_s = code, timeout_s, memory_mb, cpu_s
        self._child: Optional[SandboxedChild] = None

    @property
    def uid(self) -> Optional[int]:
        """The uid this sandbox runs as (leased for its lifetime; None without the OS boundary)."""
        return self._child.uid if self._child is not None else None

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        self.close()
        child = SandboxedChild(_CHILD, memory_mb=self.memory_mb, cpu_s=self.cpu_s)
        try:
            child.start({"code": self.code})
        except SandboxUnavailable as exc:
            child.close()
            raise RewardCodeError(str(exc)) from None
        except ChildDied:
            pass  # gone before it read its code: the reply below is missing, and says so
        self._child = child
        reply = self._recv(max(self.timeout_s, 10.0))
        if reply is None or not reply.get("ok"):
            err = (reply or {}).get("error") or f"reward process did not start ({child.exit_text()})"
            self.close()
            raise RewardCodeError(err)

    def close(self) -> None:
        if self._child is not None:
            self._child.close()
            self._child = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    # -- scoring ---------------------------------------------------------------
    def score(self, prompt: str, completion: str, fields: Optional[dict[str, Any]] = None) -> RewardResult:
        t0 = time.perf_counter()
        if self._child is None or not self._child.alive:
            self.start()
        assert self._child is not None
        try:
            self._child.send({"prompt": prompt, "completion": completion, "fields": fields or {}})
        except ChildDied:
            reply = None
        else:
            reply = self._recv(self.timeout_s)
        ms = (time.perf_counter() - t0) * 1000
        if reply is None:
            alive = self._child is not None and self._child.alive
            why = (f"timed out after {self.timeout_s:g}s" if alive
                   else f"reward process died ({self._child.exit_text() if self._child else 'not running'})")
            self.close()  # next call restarts a clean child
            return RewardResult(None, why, ms)
        if reply.get("ok"):
            return RewardResult(reply["reward"], None, ms)
        return RewardResult(None, reply.get("error", "unknown error"), ms)

    def _recv(self, timeout: float) -> Optional[dict]:
        """The child's next reply, or None: no reply in time, or the child is gone."""
        assert self._child is not None
        try:
            return self._child.recv(timeout, self.REPLY_BYTES)
        except (ChildTimeout, ChildDied, ChildFlood):
            return None


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
