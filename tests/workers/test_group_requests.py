"""Which prompt groups go to their engine as one request of ``group_size`` samples (vLLM
parallel sampling), and which as one request per sample; the engine-side behaviour is
tested through the real engine in test_engine_integration.py."""
import pytest

from workers.controller import Controller
from workers.engine_server import EngineClient
from workers.rollout import RolloutEngine
from workers.spec import validate_spec


def _controller(tmp_path, group_size=4, **rollout):
    spec = validate_spec({"name": "g", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
                          "algorithm": {"group_size": group_size}, "rollout": {"engines": 2, **rollout}})
    return Controller(spec, tmp_path / "out", progress=False)


def test_groups_are_one_request_where_every_sample_keeps_its_semantics(tmp_path):
    assert _controller(tmp_path)._one_request_per_group(RolloutEngine("unused", update_mode="keep"))
    assert _controller(tmp_path, update_mode="drain")._one_request_per_group(RolloutEngine("unused", update_mode="drain"))


@pytest.mark.parametrize("why", ["interrupt", "migrate_tail", "one_sample", "engine_server", "env"])
def test_groups_fall_back_to_a_request_per_sample(tmp_path, monkeypatch, why):
    engine = RolloutEngine("unused", update_mode="interrupt" if why == "interrupt" else "keep")
    controller = _controller(tmp_path, group_size=1 if why == "one_sample" else 4,
                             **({"migrate_tail": 2} if why == "migrate_tail" else {}),
                             **({"update_mode": "interrupt"} if why == "interrupt" else {}))
    if why == "engine_server":
        engine = EngineClient.__new__(EngineClient)  # a remote engine: single requests only
    if why == "env":
        monkeypatch.setenv("FLUXRL_GROUP_REQUESTS", "0")
    assert not controller._one_request_per_group(engine)


def test_a_group_request_is_refused_in_interrupt_mode():
    import asyncio

    engine = RolloutEngine("unused", update_mode="interrupt")

    async def first():
        return await engine.generate_group([1, 2], 4, 8, 1.0)

    with pytest.raises(ValueError, match="interrupt"):
        asyncio.run(first())
