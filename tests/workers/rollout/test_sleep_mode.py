"""Colocated GPU plans: engines start in vLLM's sleep mode and sleep through
each trainer step. What this CPU machine can check: the setting reaches vLLM's
AsyncEngineArgs, in-process and through an engine server's configuration and the wire;
vLLM itself refuses sleep mode on the CPU, which is why the planner refuses colocation
here; an engine started without it refuses to sleep. The sleep and wake themselves run in
``bench/gpu_smoke.sh`` (its colocated check asserts ``engine/sleep_s`` on every step)."""
import asyncio

import pytest

from workers.cluster.placement import Machine, PlacementError, plan_placement
from workers.rollout.engine import RolloutEngine
from workers.rollout.messages import EngineServerConfig, SleepRequest, WakeRequest
from workers.rollout.server import _Server
from workers.spec import validate_spec


def test_sleep_mode_reaches_vllms_engine_args_only_when_the_plan_sleeps(tiny_model_path):
    assert RolloutEngine(tiny_model_path, sleep_mode=True).engine_args(on_cpu=False).enable_sleep_mode is True
    assert RolloutEngine(tiny_model_path).engine_args(on_cpu=False).enable_sleep_mode is False
    config = EngineServerConfig(model_path=tiny_model_path, index=0, sleep_mode=True)
    carried = EngineServerConfig.model_validate_json(config.model_dump_json())  # the wire
    assert carried.sleep_mode is True and _Server(carried, channel=None).engine.sleep_mode is True


def test_the_sleep_and_wake_messages_are_typed():
    assert SleepRequest.model_validate_json(SleepRequest(id=3).model_dump_json()).kind == "sleep"
    assert WakeRequest.model_validate_json(WakeRequest(id=4, tags=["weights"]).model_dump_json()).tags == ["weights"]
    with pytest.raises(ValueError):
        WakeRequest(id=5, tags=["everything"])  # vLLM's tags only


def test_vllm_refuses_sleep_mode_on_the_cpu_and_so_does_the_planner(tiny_model_path):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's platform here has sleep mode")
    with pytest.raises(ValueError, match="Sleep mode is not supported on current platform"):
        RolloutEngine(tiny_model_path, sleep_mode=True).engine_args().create_engine_config()
    spec = validate_spec({"name": "c", "model": {"path": tiny_model_path}, "task": {"dataset": "gen:add"},
                          "schedule": {"mode": "sync"}, "resources": {"colocate": True}})
    with pytest.raises(PlacementError, match="vLLM has sleep mode only on GPUs"):
        plan_placement(spec, Machine(cpu_cores=2))


def test_an_engine_started_without_sleep_mode_refuses_to_sleep_and_an_awake_one_wakes_at_once(tiny_model_path):
    engine = RolloutEngine(tiny_model_path)
    with pytest.raises(RuntimeError, match="started without sleep mode"):
        asyncio.run(engine.sleep())
    assert asyncio.run(engine.wake_up(["weights"])) == 0.0 and engine.asleep is None


@pytest.mark.parametrize("asleep,tags,left", [
    ("all", None, None), ("all", ["weights"], "kv_cache"), ("all", ["kv_cache"], "weights"),
    ("all", ["weights", "kv_cache"], None), ("kv_cache", None, None), ("kv_cache", ["kv_cache"], None),
    ("kv_cache", ["weights"], "kv_cache"), ("weights", ["weights"], None), (None, None, None),
    (None, ["weights"], None)])
def test_what_sleeps_after_a_wake_is_what_slept_less_what_was_woken(asleep, tags, left):
    from workers.rollout.engine_args import asleep_after_wake

    assert asleep_after_wake(asleep, tags) == left


def test_a_wake_of_an_unknown_tag_is_refused():
    from workers.rollout.engine_args import asleep_after_wake

    with pytest.raises(ValueError, match="everything"):
        asleep_after_wake("all", ["everything"])


@pytest.mark.parametrize("answer", [None, True], ids=["vllm-0.26-None", "bool"])
def test_an_engine_is_awake_after_a_full_wake_whatever_vllm_answers(tiny_model_path, answer):
    """The wake's answer differs by vLLM version (0.26's AsyncLLM.wake_up returns None, later
    ones whether all of it is awake): what sleeps follows what was asked. A fake stands in
    for vLLM's engine only for that answer (vLLM has no sleep mode on this CPU)."""
    calls = []

    class _LLM:
        async def sleep(self, level):
            calls.append(("sleep", level))

        async def wake_up(self, tags=None):
            calls.append(("wake_up", tags))
            return answer if tags is None else (False if answer is not None else None)

    engine = RolloutEngine(tiny_model_path, sleep_mode=True)
    engine.engine = _LLM()

    async def cycle():
        await engine.sleep()
        assert engine.asleep == "all"
        await engine.wake_up(["weights"])
        assert engine.asleep == "kv_cache"
        await engine.wake_up()
        assert engine.asleep is None
        assert await engine.wake_up() == 0.0  # awake: nothing to call
        await engine.sleep()
        await engine.wake_up()  # a second cycle wakes as the first did
        assert engine.asleep is None

    asyncio.run(cycle())
    assert calls == [("sleep", 1), ("wake_up", ["weights"]), ("wake_up", None), ("sleep", 1), ("wake_up", None)]
