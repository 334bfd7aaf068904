"""Trying a team environment: one episode in a sandbox child of this process
(workers/agents/sandboxed.py), reset with a row and stepped with given turns. Runs in the
sandbox service's task (tasks.try_environment) and, in the embedded default, in the web
process, which only waits on the child: the code is never imported here. No Django: the
sandbox service has no database."""
from __future__ import annotations

import asyncio
import os
import socket
import time

from workers.agents.sandboxed import SandboxConfig, SandboxedEnvironment, SandboxPool
from workers.spec import EnvironmentSpec


def try_here(code: str, row: dict, turns: list[str], params: dict, timeout_s: float, memory_mb: int,
             output_chars: int) -> dict:
    """{"ok", "error", "steps": [{"text", "observation", "reward", "done", "error", "ms"}]}:
    the turns stop at the first that ends the episode or fails. token_ids are not known
    here (no tokenizer): each step gets an empty list."""
    spec = EnvironmentSpec(name="user", code=code, params=params, timeout_s=timeout_s, memory_mb=memory_mb,
                           output_chars=output_chars)
    pool = SandboxPool(SandboxConfig.of(spec), size=1)
    steps: list[dict] = []

    async def episode() -> None:
        environment = SandboxedEnvironment(pool)
        try:
            await environment.reset(row)
            for text in turns:
                started = time.perf_counter()
                result = await environment.step(text, [])
                observation = result.observation
                steps.append({"text": text, "reward": result.reward, "done": result.done, "error": result.error,
                              "ms": (time.perf_counter() - started) * 1000,
                              "observation": {"role": observation.role, "content": observation.content}
                              if observation else None})
                if result.done or result.error:
                    break
        finally:
            await environment.close()

    try:
        asyncio.run(episode())
    finally:
        pool.close()
    error = next((s["error"] for s in steps if s["error"]), None)
    return {"ok": error is None, "error": error, "steps": steps,
            "tried_by": {"host": socket.gethostname(), "pid": os.getpid()}}
