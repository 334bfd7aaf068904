"""A child process inside the reward sandbox's operating-system boundary, for any program.

The boundary is workers/rewards/sandbox.py's: bubblewrap namespaces, a uid leased from the
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

from workers.rewards.sandbox import CHILD_GUARDS
from workers.rewards.sandbox_boundary import (CHILD_ENV, SANDBOX_UID, SandboxUnavailable, UidLease, boundary, lease_uid,
                                              limit_child, seccomp_fd)


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


__all__ = ["ChildDied", "ChildFlood", "ChildTimeout", "SandboxUnavailable", "SandboxedChild"]
