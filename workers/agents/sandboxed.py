"""A team's own environment, run only inside the OS sandbox (task.environment.code).

The code defines ``class Environment`` (constructed with task.environment.params as keyword
arguments) with ``reset(self, row)`` (may return None) and ``step(self, text, token_ids)``
returning ``(observation, reward, done)``; the observation is a string (a ``tool`` message),
a dict ``{"role": "tool"|"user", "content": str}``, or None. An optional ``close(self)`` is
called when the episode ends.

The code never runs in the coordinator, trainer or web process. A small pool of long-lived
sandboxed children (workers/rewards/process.py: bubblewrap, seccomp, rlimits, a leased uid)
holds the episodes' instances, each episode pinned to one child, which answers one JSON
line per call. Each call has the wall-clock deadline ``timeout_s``; the child has the memory
cap ``memory_mb``; what the code prints in a call is capped at ``output_chars`` characters
and an observation at ``OBSERVATION_FACTOR`` times that; fork is refused. A call that hangs,
raises, floods or forks ends its episode with a named reason (``StepResult.error``, the
episode's end_detail), e.g. "step timed out after 5 s", "output over 4000 characters",
"PermissionError: sandbox: os.fork is not allowed in the sandbox (line 7)". When the child
had to be killed, it is restarted and every other episode pinned to it is replayed (reset
with its row, then its turns again), so they go on; an environment whose answers depend on
more than the row and the turns (its own clock, unseeded randomness) may answer those
replayed episodes differently.
"""
from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from workers.agents.api import Observation, StepResult
from workers.spec import EnvironmentSpec

logger = logging.getLogger(__name__)

SANDBOXES_PER_ENVIRONMENT = 4  # children one environment's episodes share (started as needed)
OBSERVATION_FACTOR = 4  # an observation may be this many times output_chars
START_TIMEOUT_S = 10.0  # starting a child and loading the code, at least
CHILD_CPU_S = 3600  # a long-lived child's CPU seconds (RLIMIT_CPU); past it, it is restarted

# After the sandbox's guards (workers/rewards/process.py CHILD_GUARDS).
_ENV_CHILD = r'''
import io, math
# The protocol gets file descriptors of its own; fd 1 then points where stderr does (nowhere),
# so nothing the code writes reaches the protocol.
proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
os.dup2(2, 1)
proto_in, sys.stdin = sys.stdin, io.StringIO()
def reply(**kw):
    proto_out.write(json.dumps(kw, ensure_ascii=False) + "\n"); proto_out.flush()
LIMIT, OBS_LIMIT = first["output_chars"], first["observation_chars"]
class Sink(io.TextIOBase):
    """Counts what the code prints in a call; past the cap every write raises."""
    n, flooded = 0, False
    def writable(self):
        return True
    def write(self, s):
        self.n += len(s)
        if self.n > LIMIT:
            self.flooded = True
            raise RuntimeError(f"output over {LIMIT} characters")
        return len(s)
sink = Sink()
sys.stdout = sys.stderr = sink
def described(exc):
    tb = traceback.extract_tb(exc.__traceback__)
    where = next((f"line {f.lineno}" for f in reversed(tb) if f.filename == "<environment>"), "")
    return f"{type(exc).__name__}: {exc}" + (f" ({where})" if where else "")
ns = {"__name__": "environment_module"}
try:
    exec(compile(code, "<environment>", "exec"), ns)
    cls = ns.get("Environment")
    if not isinstance(cls, type) or not callable(getattr(cls, "step", None)):
        raise TypeError("the code must define a class Environment with reset(self, row) and step(self, text, token_ids)")
except BaseException as exc:
    reply(ok=False, error=described(exc)); sys.exit(0)
reply(ok=True)
params, envs = first.get("params") or {}, {}
def checked(got):
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        raise TypeError(f"step must return (observation, reward, done), not {type(got).__name__}")
    obs, reward, done = got
    if isinstance(obs, str):
        obs = {"role": "tool", "content": obs}
    elif isinstance(obs, dict):
        if obs.get("role", "tool") not in ("tool", "user") or not isinstance(obs.get("content"), str):
            raise TypeError("an observation dict must be {'role': 'tool' or 'user', 'content': str}")
        obs = {"role": obs.get("role", "tool"), "content": obs["content"]}
    elif obs is not None:
        raise TypeError(f"the observation must be a string, a dict or None, not {type(obs).__name__}")
    if obs is not None and len(obs["content"]) > OBS_LIMIT:
        raise ValueError(f"observation over {OBS_LIMIT} characters")
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"the reward must be a finite number, got {reward}")
    return {"observation": obs, "reward": reward, "done": bool(done)}
for line in proto_in:
    req = json.loads(line)
    op, eid = req["op"], req["id"]
    sink.n, sink.flooded = 0, False
    try:
        result = {}
        if op == "reset":
            envs[eid] = cls(**params)
            if callable(getattr(envs[eid], "reset", None)):
                envs[eid].reset(req["row"])
        elif op == "step":
            if eid not in envs:
                raise KeyError(f"episode {eid} has no environment (it failed before)")
            result = checked(envs[eid].step(req["text"], req["token_ids"]))
        else:
            env = envs.pop(eid, None)
            if env is not None and callable(getattr(env, "close", None)):
                env.close()
        if sink.flooded:
            raise RuntimeError(f"output over {LIMIT} characters")
        reply(ok=True, **result)
    except BaseException as exc:
        envs.pop(eid, None)
        error = (f"output over {LIMIT} characters" if sink.flooded else
                 "MemoryError: the environment exceeded its memory limit" if isinstance(exc, MemoryError) else
                 described(exc))
        reply(ok=False, error=error)
'''


class EnvironmentFailed(Exception):
    """A call failed: its message is the episode's end_detail."""


@dataclass(frozen=True)
class SandboxConfig:
    code: str
    params_json: str
    timeout_s: float
    memory_mb: int
    output_chars: int

    @classmethod
    def of(cls, spec: EnvironmentSpec) -> SandboxConfig:
        return cls(spec.code or "", json.dumps(spec.params, sort_keys=True), spec.timeout_s, spec.memory_mb,
                   spec.output_chars)

    @property
    def reply_bytes(self) -> int:
        # An observation of OBSERVATION_FACTOR x output_chars characters, JSON-escaped, and room for the rest.
        return 6 * OBSERVATION_FACTOR * self.output_chars + 65536


@dataclass
class _Episode:
    row: dict
    turns: list[tuple[str, list[int]]] = field(default_factory=list)


class EnvironmentSandbox:
    """One sandboxed child holding the instances of the episodes pinned to it. Calls run one
    at a time on its own thread (``executor``), each blocking on the child's pipe."""

    def __init__(self, config: SandboxConfig):
        self.config = config
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="fluxrl-environment")
        self.episodes: dict[str, _Episode] = {}
        self.lost: dict[str, str] = {}  # episodes whose replay after a restart failed: why
        self.pinned = 0  # episodes pinned here (the pool's balance)
        self.restarts = 0
        self._child = None
        self._broken: Optional[str] = None  # the code does not load: every call fails with this

    # -- blocking, on the executor's thread -------------------------------------------
    def call(self, op: str, eid: str, **payload: Any) -> dict:
        """One request for episode ``eid``: the child's answer, or EnvironmentFailed."""
        if eid in self.lost:
            raise EnvironmentFailed(self.lost.pop(eid))
        self._ensure()
        try:
            answer = self._request(op, eid, payload)
        except EnvironmentFailed:
            self.episodes.pop(eid, None)
            raise
        if op == "reset":
            self.episodes[eid] = _Episode(payload["row"])
        elif op == "step":
            self.episodes[eid].turns.append((payload["text"], payload["token_ids"]))
        else:
            self.episodes.pop(eid, None)
        return answer

    def release(self, eid: str) -> None:
        self.episodes.pop(eid, None)
        self.lost.pop(eid, None)

    def _request(self, op: str, eid: str, payload: dict) -> dict:
        from workers.rewards.process import ChildDied, ChildFlood, ChildTimeout

        timeout = self.config.timeout_s
        try:
            self._child.send({"op": op, "id": eid, **payload})
            answer = self._child.recv(timeout, self.config.reply_bytes)
        except ChildTimeout:
            self._restart_later(f"{op} of episode {eid} timed out")
            raise EnvironmentFailed(f"{op} timed out after {timeout:g} s") from None
        except ChildFlood:
            self._restart_later(f"{op} of episode {eid} flooded its reply")
            raise EnvironmentFailed(f"{op} reply over {self.config.reply_bytes} bytes") from None
        except ChildDied as exc:
            why = self._child.exit_text() if not self._child.alive else str(exc)
            self._restart_later(f"{op} of episode {eid}: the child died ({why})")
            raise EnvironmentFailed(f"the environment process died in {op} ({why})") from None
        if not answer.get("ok"):
            raise EnvironmentFailed(str(answer.get("error") or "unknown error"))
        return answer

    def _restart_later(self, why: str) -> None:
        logger.warning("environment sandbox killed (%s); restarting it for its other episodes", why)
        self._child.close()
        self.restarts += 1

    def _ensure(self) -> None:
        """A running child holding every pinned episode's state: start it, then replay the
        episodes (a replay that fails loses only that episode, named in ``lost``)."""
        if self._broken:
            raise EnvironmentFailed(self._broken)
        while self._child is None or not self._child.alive:
            self._start()
            for eid, episode in list(self.episodes.items()):
                try:
                    self._request("reset", eid, {"row": episode.row})
                    for text, ids in episode.turns:
                        self._request("step", eid, {"text": text, "token_ids": ids})
                except EnvironmentFailed as exc:
                    self.episodes.pop(eid, None)
                    self.lost[eid] = f"replaying the episode after a sandbox restart failed: {exc}"
                if not self._child.alive:
                    break  # killed in that replay: start again and replay the rest

    def _start(self) -> None:
        from workers.rewards.process import ChildDied, ChildFlood, ChildTimeout, SandboxedChild, SandboxUnavailable

        if self._child is not None:
            self._child.close()
        cfg = self.config
        self._child = SandboxedChild(_ENV_CHILD, memory_mb=cfg.memory_mb, cpu_s=CHILD_CPU_S)
        try:
            self._child.start({"code": cfg.code, "where": "the sandbox", "params": json.loads(cfg.params_json),
                               "output_chars": cfg.output_chars,
                               "observation_chars": OBSERVATION_FACTOR * cfg.output_chars})
            answer = self._child.recv(max(START_TIMEOUT_S, cfg.timeout_s), cfg.reply_bytes)
        except SandboxUnavailable as exc:
            self._child.close()
            raise EnvironmentFailed(f"the sandbox cannot start: {exc}") from None
        except (ChildTimeout, ChildFlood, ChildDied) as exc:
            why = self._child.exit_text()
            self._child.close()
            raise EnvironmentFailed(f"the environment did not start ({type(exc).__name__}: {why})") from None
        if not answer.get("ok"):
            self._child.close()
            self._broken = f"the environment code does not load: {answer.get('error')}"
            raise EnvironmentFailed(self._broken)

    def close(self) -> None:
        if self._child is not None:
            self._child.close()
        self.executor.shutdown(wait=False)


class SandboxPool:
    """The sandboxes of one environment (its code, params and caps); episodes are pinned to
    the least busy one."""

    def __init__(self, config: SandboxConfig, size: int = SANDBOXES_PER_ENVIRONMENT):
        self.config = config
        self.sandboxes = [EnvironmentSandbox(config) for _ in range(max(1, size))]
        self._lock = threading.Lock()

    def pin(self) -> EnvironmentSandbox:
        with self._lock:
            sandbox = min(self.sandboxes, key=lambda s: s.pinned)
            sandbox.pinned += 1
            return sandbox

    def unpin(self, sandbox: EnvironmentSandbox) -> None:
        with self._lock:
            sandbox.pinned -= 1

    def close(self) -> None:
        for sandbox in self.sandboxes:
            sandbox.close()


_pools: dict[SandboxConfig, SandboxPool] = {}
_pools_lock = threading.Lock()
_episode_ids = itertools.count(1)


def pool_for(spec: EnvironmentSpec) -> SandboxPool:
    config = SandboxConfig.of(spec)
    with _pools_lock:
        if config not in _pools:
            _pools[config] = SandboxPool(config)
        return _pools[config]


def close_pools() -> None:
    """Stop every environment sandbox of this process (at exit; tests)."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.close()


atexit.register(close_pools)


class SandboxedEnvironment:
    """One episode of a user environment, pinned to one sandbox of its pool. A failed reset
    is answered by the first step (``StepResult.error``), as every later failure is."""

    def __init__(self, pool: SandboxPool):
        self.pool = pool
        self.id = f"e{next(_episode_ids)}"
        self.sandbox: Optional[EnvironmentSandbox] = None
        self.error: Optional[str] = None

    async def _call(self, op: str, **payload: Any) -> dict:
        sandbox = self.sandbox
        try:
            return await asyncio.get_running_loop().run_in_executor(
                sandbox.executor, lambda: sandbox.call(op, self.id, **payload))
        except EnvironmentFailed:
            raise
        except Exception as exc:  # the machinery failed (an OS error starting the child, a closed pool)
            logger.warning("environment episode %s: %s failed: %r", self.id, op, exc)
            raise EnvironmentFailed(f"{op} failed in the sandbox machinery ({type(exc).__name__}: {exc})") from None

    async def reset(self, row: dict[str, Any]) -> None:
        if self.sandbox is None:
            self.sandbox = self.pool.pin()
        try:
            await self._call("reset", row=_jsonable(row))
        except EnvironmentFailed as exc:
            self.error = str(exc)

    async def step(self, text: str, token_ids: Sequence[int]) -> StepResult:
        if self.error is None and self.sandbox is None:
            self.error = "step before reset"
        if self.error is not None:
            return StepResult(done=True, error=self.error)
        try:
            answer = await self._call("step", text=text, token_ids=[int(t) for t in token_ids])
        except EnvironmentFailed as exc:
            self.error = str(exc)
            return StepResult(done=True, error=self.error)
        obs = answer.get("observation")
        return StepResult(observation=Observation(obs["content"], obs["role"]) if obs else None,
                          reward=float(answer.get("reward", 0.0)), done=bool(answer.get("done")))

    async def close(self) -> None:
        if self.sandbox is None:
            return
        sandbox, self.sandbox = self.sandbox, None
        try:
            if self.error is None:
                self.sandbox = sandbox
                await self._call("close")
        except EnvironmentFailed as exc:
            logger.info("closing environment episode %s: %s", self.id, exc)
        finally:
            self.sandbox = None
            try:
                sandbox.executor.submit(sandbox.release, self.id)
            except RuntimeError:  # the pool was closed meanwhile: nothing left to release
                pass
            self.pool.unpin(sandbox)


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    """The row as JSON carries it (a value JSON cannot hold becomes its string)."""
    return json.loads(json.dumps(row, default=str))


def make_sandboxed_environment(spec: EnvironmentSpec) -> SandboxedEnvironment:
    """A fresh episode of the user environment ``spec.code``, in its pool of sandboxes."""
    if not spec.code:
        raise ValueError("a sandboxed environment needs task.environment.code")
    return SandboxedEnvironment(pool_for(spec))
