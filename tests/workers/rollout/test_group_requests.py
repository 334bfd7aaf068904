"""Which prompt groups go to their engine as one request of ``group_size`` samples (vLLM
parallel sampling), and which as one request per sample; the engine-side behaviour is
tested through the real engine in test_engine_integration.py."""
import pytest

from workers.coord.controller import Controller
from workers.rollout.client import EngineClient
from workers.rollout.messages import EngineServerConfig
from workers.rollout.engine import RolloutEngine
from workers.spec import validate_spec


def _controller(tmp_path, group_size=4, **rollout):
    spec = validate_spec({"name": "g", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
                          "algorithm": {"group_size": group_size}, "rollout": {"engines": 2, **rollout}})
    return Controller(spec, tmp_path / "out", progress=False)


@pytest.mark.parametrize("engine_kind", ["in_process", "engine_server"])
def test_groups_are_one_request_where_every_sample_keeps_its_semantics(tmp_path, engine_kind):
    def engine(mode):
        if engine_kind == "in_process":
            return RolloutEngine("unused", update_mode=mode)
        return EngineClient(EngineServerConfig(model_path="unused", index=0, update_mode=mode))

    assert _controller(tmp_path)._one_request_per_group(engine("keep"))
    assert _controller(tmp_path, update_mode="drain")._one_request_per_group(engine("drain"))


@pytest.mark.parametrize("why", ["interrupt", "migrate_tail", "one_sample", "switched_off"])
def test_groups_fall_back_to_a_request_per_sample(tmp_path, why):
    engine = RolloutEngine("unused", update_mode="interrupt" if why == "interrupt" else "keep")
    controller = _controller(tmp_path, group_size=1 if why == "one_sample" else 4,
                             **({"migrate_tail": 2} if why == "migrate_tail" else {}),
                             **({"update_mode": "interrupt"} if why == "interrupt" else {}),
                             **({"group_requests": False} if why == "switched_off" else {}))
    assert not controller._one_request_per_group(engine)


def test_a_group_request_is_refused_in_interrupt_mode():
    import asyncio

    engine = RolloutEngine("unused", update_mode="interrupt")

    async def first():
        return await engine.generate_group([1, 2], 4, 8, 1.0)

    with pytest.raises(ValueError, match="interrupt"):
        asyncio.run(first())
