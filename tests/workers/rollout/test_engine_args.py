"""rollout.enforce_eager: eager on the CPU, CUDA graphs on GPUs unless the
spec says otherwise, and what reaches vLLM's AsyncEngineArgs, in-process and through an
engine server's configuration (building the arguments starts no engine)."""
import pytest

from workers.rollout.engine import RolloutEngine
from workers.rollout.engine_args import resolve_enforce_eager
from workers.rollout.messages import EngineServerConfig
from workers.spec import validate_spec


@pytest.mark.parametrize("setting, on_cpu, eager", [
    (None, True, True), (None, False, False),  # by device
    (True, True, True), (True, False, True),  # eager everywhere
    (False, True, False), (False, False, False),  # compiled / CUDA graphs everywhere
])
def test_the_resolution_rule(setting, on_cpu, eager):
    assert resolve_enforce_eager(setting, on_cpu) is eager


def test_the_spec_field_defaults_to_by_device_and_takes_a_bool():
    base = {"name": "e", "model": {"path": "m"}, "task": {"dataset": "gen:add"}}
    assert validate_spec(base).rollout.enforce_eager is None
    assert validate_spec({**base, "rollout": {"enforce_eager": False}}).rollout.enforce_eager is False
    assert "enforce_eager" in validate_spec(base).to_dict()["rollout"]


@pytest.mark.parametrize("setting, on_cpu, eager", [(None, True, True), (None, False, False), (True, False, True),
                                                    (False, True, False)])
def test_what_reaches_async_engine_args(setting, on_cpu, eager, tiny_model_path):
    engine = RolloutEngine(tiny_model_path, dtype="bfloat16", max_model_len=128, enforce_eager=setting,
                           gpu_memory_utilization=0.5)
    args = engine.engine_args(on_cpu=on_cpu)
    assert args.enforce_eager is eager
    assert (args.model, args.dtype, args.max_model_len, args.gpu_memory_utilization) == (tiny_model_path, "bfloat16",
                                                                                           128, 0.5)
    assert args.enable_prefix_caching is False and args.logprobs_mode == "processed_logprobs"


def test_on_this_machine_the_default_is_vllms_platform(tiny_model_path):
    from vllm.platforms import current_platform

    assert RolloutEngine(tiny_model_path).engine_args().enforce_eager is current_platform.is_cpu()


def test_an_engine_servers_configuration_carries_it_to_its_engine(tiny_model_path):
    from workers.rollout.server import _Server

    for setting in (None, True, False):
        config = EngineServerConfig(model_path=tiny_model_path, index=0, enforce_eager=setting)
        assert EngineServerConfig.model_validate_json(config.model_dump_json()).enforce_eager is setting  # the wire
        server = _Server(config, channel=None)
        assert server.engine.enforce_eager is setting
        assert server.engine.engine_args(on_cpu=False).enforce_eager is resolve_enforce_eager(setting, False)
