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
