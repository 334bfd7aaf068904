"""A run whose trainer is two DeepSpeed rank processes (data parallel, ZeRO 2 and 3, gloo)
or one (out of the coordinator's process),
its weights sent over vLLM's RPC or broadcast over a gloo group by trainer rank 0: the engine trains through
them, keeps staleness within η, and after every update the weights the rollout engine
holds are the trainer's, checksum for checksum."""
import asyncio

import pytest

from workers.coord.controller import Controller
from workers.spec import validate_spec
from workers.weights.sync import tensors_checksum

pytestmark = [pytest.mark.engine, pytest.mark.distributed, pytest.mark.timeout(600)]


class CheckingController(Controller):
    """After every weight update, the engines' checksum against the trainer's full weights."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.checks: list[tuple[int, bool]] = []

    async def _send_weights(self, version):
        timings = await super()._send_weights(version)
        trainer = tensors_checksum(await asyncio.to_thread(self.processes.trainer.state_dict))
        engines = [await e.weights_checksum() for e in self.fleet.engines]
        self.checks.append((version, all(c == trainer for c in engines)))
        return timings


# Two ranks at ZeRO-3 broadcasting over the collective (trainer rank 0 sending, the engines checked
# after every update, the ranks gone after) are tests/workers/cluster/test_two_node_run.py's, over
# two nodes: not run here again.
@pytest.mark.parametrize("ranks, stage, transport", [pytest.param(2, 2, "rpc", marks=pytest.mark.slow), (1, 0, "collective")])
def test_trainer_rank_processes_train_an_async_run_and_the_engine_holds_their_weights(ranks, stage, transport,
                                                                                        tmp_path):
    """Two ranks, or one (``resources.trainer_process``: the trainer out of the coordinator's process)."""
    steps = 6
    spec = validate_spec({
        "name": f"ranks-zero{stage}", "model": {"path": "builtin:tiny"},
        "task": {"dataset": "gen:add?max_digits=2", "size": 400, "eval_size": 20},
        "algorithm": {"lr": 3e-4, "group_size": 4, "warmup_steps": 0},
        "rollout": {"max_tokens": 8, "update_mode": "keep", "weight_transport": transport},
        "schedule": {"mode": "async", "max_staleness": 1, "batch_prompts": 4},
        "trainer": {"zero_stage": stage},
        "resources": {"trainer_ranks": ranks, "trainer_process": ranks == 1},
        "stop": {"max_steps": steps, "max_minutes": 6},
        "eval": {"every_steps": 0, "prompts": 20},
    })
    controller = CheckingController(spec, tmp_path / "out", progress=False)
    result = asyncio.run(controller.run())
    assert result.steps == steps and result.staleness_max <= 1
    assert len(controller.checks) >= steps and all(ok for _, ok in controller.checks), controller.checks
    if transport == "collective":  # sent by trainer rank 0 itself, not through this process
        from workers.weights.broadcast import RankZeroSender

        broadcaster = controller.fleet.weights.broadcaster
        assert isinstance(broadcaster.sender, RankZeroSender) and broadcaster.last_send_ms
    pids = controller.processes.trainer.pids
    assert len(pids) == ranks
    import os
    assert not any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
                   for pid in pids)  # the rank processes are gone with the run
