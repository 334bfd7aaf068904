"""A rollout engine that dies mid-run (its EngineCore process is SIGKILLed while it has
requests in flight): those requests continue from their prefix on the other engine,
weight updates skip the dead one, and the run trains every step on every accepted
sample. And engine calls that never answer fail instead
of hanging (the timeout and death paths, without a real engine)."""
import asyncio
import json
import logging
import os
import signal
import time

import pytest

import workers.coord.generation as generation_module
from workers.cli.engine import LOG_FORMAT
from workers.coord.controller import Controller
from workers.rollout.engine import RolloutEngine
from workers.rollout.engine_types import EngineDied, EngineRPCTimeout
from workers.spec import validate_spec
from workers.weights.update import InlineWeights

STEPS, PROMPTS, GROUP = 4, 2, 2


def spec(model_path):
    return validate_spec({
        "name": "engine-death", "model": {"path": model_path},
        "task": {"dataset": "gen:add?max_digits=2", "size": 100, "eval_size": 2},
        "algorithm": {"loss": "ppo", "group_size": GROUP, "lr": 1.0e-3},
        "rollout": {"engines": 2, "max_tokens": 24, "update_mode": "keep", "rpc_timeout_s": 30},
        "schedule": {"mode": "async", "max_staleness": 1, "batch_prompts": PROMPTS},
        "stop": {"max_steps": STEPS, "max_minutes": 4},
        "eval": {"every_steps": 0, "prompts": 2},
    })


@pytest.mark.engine
@pytest.mark.timeout(300)
def test_a_dead_rollout_engine_loses_no_accepted_sample(tmp_path, tiny_model_path, capfd, monkeypatch):
    controller = Controller(spec(tiny_model_path), tmp_path / "out", progress=False)
    seen = {"continued": 0}
    real_continue_on = generation_module.continue_on

    async def counting_continue_on(engine, done, *args, **kwargs):
        if done.finish_reason == "engine_died":
            seen["continued"] += 1
            assert engine.index != done.engine and not engine.dead
        return await real_continue_on(engine, done, *args, **kwargs)

    monkeypatch.setattr(generation_module, "continue_on", counting_continue_on)
    # diagnostics are logged; the CLI sends them to stderr (workers/cli/engine.py), so here too
    workers_log = logging.getLogger("workers")
    to_stderr = logging.StreamHandler()
    to_stderr.setFormatter(logging.Formatter(LOG_FORMAT))
    monkeypatch.setattr(workers_log, "handlers", [*workers_log.handlers, to_stderr])

    async def kill_engine_zero_mid_run():
        while controller.reporter.latest.get("version/current", 0) < 1:
            await asyncio.sleep(0.02)
        engine = next(e for e in controller.fleet.engines if e.index == 0)
        # its vLLM process: the engine server itself when vLLM runs inside it (the CPU default)
        victim = (engine.core_pids() or [engine.server_pid])[0]
        while True:
            while not engine.active:  # requests in flight on it
                await asyncio.sleep(0.002)
            # Frozen, it finishes nothing more: what has not come back once the replies already
            # on their way have arrived is unfinished for certain (a short sample can finish
            # between a look at `active` and a kill).
            os.kill(victim, signal.SIGSTOP)
            await asyncio.sleep(0.3)
            if engine.active:
                break
            os.kill(victim, signal.SIGCONT)
        seen["in_flight"] = len(engine.active)
        os.kill(victim, signal.SIGKILL)

    async def scenario():
        killer = asyncio.create_task(kill_engine_zero_mid_run())
        t0 = time.monotonic()
        result = await controller.run()
        seen["run_s"] = time.monotonic() - t0
        killer.cancel()
        await asyncio.gather(killer, return_exceptions=True)
        return result

    t0 = time.monotonic()
    result = asyncio.run(scenario())
    print(f"\nrun {seen['run_s']:.1f} s, all {time.monotonic() - t0:.1f} s")
    assert seen.get("in_flight", 0) > 0
    assert seen["continued"] > 0  # the dead engine's in-flight sequences went on elsewhere
    assert result.steps == STEPS and result.trained_samples == STEPS * PROMPTS * GROUP
    assert controller.fleet.engine_deaths == 1
    err = capfd.readouterr().err
    assert "WARNING workers.coord.generation: rollout engine 0 died" in err
    points = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    by_step = lambda key: [p["value"] for p in sorted((p for p in points if p["key"] == key), key=lambda p: p["step"])]
    deaths, live = by_step("rollout/engine_deaths"), by_step("rollout/engines_live")
    assert deaths[0] == 0 and deaths[-1] == 1
    assert live[0] == 2 and live[-1] == 1
    assert by_step("version/current") == list(range(1, STEPS + 1))


class _NeverAnswers:
    """An AsyncLLM stand-in whose calls never return (a wedged engine core)."""

    def __init__(self):
        self.errored = False
        self.engine_core = self

    async def _forever(self, *args, **kwargs):
        await asyncio.Event().wait()

    async def abort(self, request_ids):
        return None

    pause_scheduler_async = resume_scheduler_async = set_weight_version_async = collective_rpc = _forever


def _fake_engine(timeout_s):
    eng = RolloutEngine("unused", rpc_timeout_s=timeout_s)
    eng.engine = _NeverAnswers()
    return eng


@pytest.mark.parametrize("mode", ["keep", "interrupt", "drain"])
def test_a_weight_update_a_wedged_engine_never_answers_fails_with_a_clear_error(mode):
    eng = _fake_engine(0.2)
    eng.update_mode = mode

    async def go():
        t0 = time.monotonic()
        with pytest.raises(EngineRPCTimeout, match="did not answer .* within 0.2 s"):
            await eng.update_weights(InlineWeights(b""), 1)
        return time.monotonic() - t0

    if mode == "drain":  # pausing waits for running requests however long: only the next call times out
        eng.engine.pause_scheduler_async = _instant
    assert asyncio.run(go()) < 2
    assert eng.version == 0


async def _instant(*args, **kwargs):
    return None


def test_a_pending_call_fails_as_soon_as_the_engine_dies():
    """vLLM never resolves a utility call pending when the core dies; we notice the death."""
    eng = _fake_engine(60)

    async def go():
        async def die_soon():
            await asyncio.sleep(0.1)
            eng.engine.errored = True

        killer = asyncio.create_task(die_soon())
        t0 = time.monotonic()
        with pytest.raises(EngineDied):
            await eng.update_weights(InlineWeights(b""), 1)
        await killer
        return time.monotonic() - t0

    assert asyncio.run(go()) < 2
