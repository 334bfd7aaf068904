"""Weights of any size on every path: with the wire's blob cap at 1 MiB, below
the tiny model's weights, a run trains on both transports, and after every update the
engines hold the trainer's weights checksum for checksum. The RPC path sends the file in
chunks of at most 1 MiB to engine servers (one blob would be refused by the cap, and
every engine would die at the first update), or, to a server on this host, names the
file by its path; the collective's buckets do not go through the wire. With the trainer in rank processes, rank 0 writes the file itself."""
import asyncio
import os

import pytest

from workers.coord.controller import Controller
from workers.rollout import client
from workers.spec import validate_spec
from workers.weights.sync import tensors_checksum

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


class CheckingController(Controller):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.checks: list[bool] = []

    async def _send_weights(self, version):
        timings = await super()._send_weights(version)
        trainer = tensors_checksum(await asyncio.to_thread(self.processes.trainer.state_dict))
        self.checks.append(all([await e.weights_checksum() == trainer for e in self.fleet.engines]))
        return timings


@pytest.mark.parametrize("transport, trainer_process, by_path", [("rpc", True, False), ("rpc", False, True),
                                                                   ("collective", False, False)])
def test_a_run_trains_on_both_transports_with_a_one_mib_cap_on_every_frame(transport, trainer_process, by_path,
                                                                           tmp_path, monkeypatch):
    """``by_path``: the engine servers see this process's files, and take each update's file
    by its path (nothing on the wire after the start's weights); else every update is sent."""
    monkeypatch.setenv("FLUXRL_WIRE_MAX_BLOB_MB", "1")
    monkeypatch.setenv(client.BY_PATH_ENV, "1" if by_path else "0")
    sent = []
    read_chunks = client.read_chunks

    def counted(path, size=None):
        for offset, data in read_chunks(path, size):
            sent.append(len(data))
            yield offset, data

    monkeypatch.setattr(client, "read_chunks", counted)
    steps = 3
    spec = validate_spec({
        "name": f"bounded-{transport}", "model": {"path": "builtin:tiny"},
        "task": {"dataset": "gen:add?max_digits=2", "size": 200, "eval_size": 8},
        "algorithm": {"lr": 3e-4, "group_size": 2, "warmup_steps": 0},
        "rollout": {"max_tokens": 8, "weight_transport": transport},
        "schedule": {"mode": "sync", "batch_prompts": 2},
        "resources": {"trainer_process": trainer_process},
        "stop": {"max_steps": steps, "max_minutes": 6},
        "eval": {"every_steps": 0, "prompts": 8},
    })
    controller = CheckingController(spec, tmp_path / "out", progress=False)
    result = asyncio.run(controller.run())
    assert result.steps == steps
    assert len(controller.checks) >= steps and all(controller.checks), controller.checks
    if transport == "rpc":
        weights = os.path.getsize(os.path.join(controller.spec.model.path, "model.safetensors"))
        assert weights > 1 << 20  # the model is over the cap: it had to go in pieces
        assert all(e.same_files == by_path for e in controller.fleet.engines)
        if by_path:  # no update on the wire: at most a start's weights (the server's view is not known before)
            assert all(n == 1 << 20 for n in sent[:-1]) and sum(sent) < 2 * weights, sent
        else:
            assert max(sent) <= 1 << 20 and len(sent) >= 2 * (steps + 1), sent  # the start's weights and each update's
    else:
        assert not sent
