"""A run over two "nodes" on loopback: node 0 is the coordinator (this test's process,
with one trainer rank and one engine server), node 1 a node agent started as a separate
process tree (``python -m workers node``) with the other trainer rank and engine server.
The two ranks form one DeepSpeed world (ZeRO 3, gloo); the engines are served
over the typed protocol of workers/rollout/messages.py. It trains, keeps staleness within
η, and after every update both engines hold exactly the trainer's weights. A killed
rank fails the run naming it, every process of the run is gone, and a resumed run
continues from the checkpoint with no gap in its steps."""
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers.io.checkpoint import latest_checkpoint
from workers.io.ports import free_port
from workers.coord.controller import Controller, TrainerError
from workers.spec import validate_spec
from workers.weights.sync import tensors_checksum

pytestmark = [pytest.mark.engine, pytest.mark.distributed, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[3]
STEPS = 4  # checkpointed at 2, killed at 3, resumed for 3 and 4


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except OSError:
        return False


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.split("\n")
    children: dict[int, list[int]] = {}
    for line in out:
        if line.strip():
            p, pp = map(int, line.split())
            children.setdefault(pp, []).append(p)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class CheckingController(Controller):
    """After every weight update, every engine's checksum against the trainer's weights."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.checks: list[tuple[int, list[bool]]] = []

    async def _send_weights(self, version):
        timings = await super()._send_weights(version)
        trainer = tensors_checksum(await asyncio.to_thread(self.processes.trainer.state_dict))
        self.checks.append((version, [await e.weights_checksum() == trainer for e in self.fleet.engines]))
        return timings


def _spec(stage: int, transport: str, steps: int, **trainer) -> dict:
    return {
        "name": f"two-nodes-zero{stage}", "model": {"path": "builtin:tiny"},
        "task": {"dataset": "gen:add?max_digits=2", "size": 400, "eval_size": 16},
        "algorithm": {"lr": 3e-4, "group_size": 4, "warmup_steps": 0},
        "rollout": {"engines": 2, "max_tokens": 8, "update_mode": "keep", "weight_transport": transport},
        "schedule": {"mode": "async", "max_staleness": 1, "batch_prompts": 4},
        "trainer": {"zero_stage": stage, **trainer},
        "resources": {"nodes": 2, "trainer_ranks": 2},
        "stop": {"max_steps": steps, "max_minutes": 8},
        "eval": {"every_steps": 0, "prompts": 16},
    }


@pytest.fixture
def cluster_env(monkeypatch):
    monkeypatch.setenv("FLUXRL_CLUSTER_KEY", secrets.token_hex(32))
    return f"127.0.0.1:{free_port('127.0.0.1')}"  # outside the ephemeral range: the resumed run binds it again


def _start_node(rendezvous: str, log_path: Path) -> subprocess.Popen:
    """Node 1: its own process tree (a new session), as on another machine."""
    return subprocess.Popen([sys.executable, "-m", "workers", "node", "--rendezvous", rendezvous, "--node-rank", "1"],
                            cwd=ROOT, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, start_new_session=True)


def _run(controller) -> object:
    return asyncio.run(controller.run())


def _assert_trained_on_both_nodes(controller, result, steps, trained_here):
    """Every step trained within η = 1, both nodes' engines generated and held the trainer's
    weights after every update (``trained_here`` of them in this run), nothing left behind."""
    assert result.steps == steps and result.staleness_max <= 1
    assert len(controller.fleet.engines) == 2 and {e.index for e in controller.fleet.engines} == {0, 1}
    assert len(controller.checks) >= trained_here and all(all(ok) and len(ok) == 2 for _, ok in controller.checks), \
        controller.checks
    # both engines generated: the work was spread over the two nodes
    assert all(e.generated_tokens > 0 for e in controller.fleet.engines)
    servers = [e.server_pid for e in controller.fleet.engines]
    assert not any(_alive(pid) for pid in servers + controller.processes.trainer.pids)  # nothing left behind


# One test, two node start-ups: a two-node run (ZeRO-3, trainer rank 0 broadcasting to both
# nodes' engines over the collective) trains, is failed by a killed rank, and resumes from its
# checkpoint as a full two-node run; the checks hold after every update of both runs. (ZeRO-2
# and the RPC transport over rank processes are tests/workers/coord/test_distributed_run.py's.)
def test_a_killed_rank_fails_the_two_node_run_and_the_resumed_run_trains_on_both_nodes_without_gaps(tmp_path,
                                                                                                     cluster_env):
    from workers.weights.broadcast import RankZeroSender

    out = tmp_path / "out"
    spec = _spec(3, "collective", STEPS, checkpoint_every=2)
    node = _start_node(cluster_env, tmp_path / "node1.log")

    class KillAtStep3(CheckingController):
        async def train_on(self, groups, step, t_start, stats=None):
            if step == 3:  # node 1's trainer rank dies mid-run (before this step trains)
                rank1 = self.processes.node_trainer_pids[1][0]
                assert rank1 in _descendants(node.pid)  # in node 1's process tree
                os.kill(rank1, signal.SIGKILL)
                self.killed_at = time.monotonic()
            return await super().train_on(groups, step, t_start, stats)

    controller = KillAtStep3(validate_spec(spec), out, progress=False, rendezvous=cluster_env)
    try:
        with pytest.raises(TrainerError) as failure:
            _run(controller)
        failed_after = time.monotonic() - controller.killed_at
        node.wait(timeout=30)
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
    assert "trainer rank 1" in str(failure.value) and "SIGKILL" in str(failure.value), str(failure.value)
    assert failed_after < 30
    assert not any(_alive(e.server_pid) for e in controller.fleet.engines + controller.fleet.dead)
    assert not any(_alive(pid) for pid in controller.processes.trainer.pids)
    # before the kill: both nodes' engines held the trainer's weights after every update (the first, steps 1-2),
    # broadcast by trainer rank 0 itself
    assert [v for v, _ in controller.checks] == [0, 1, 2] and all(all(ok) and len(ok) == 2 for _, ok in controller.checks)
    broadcaster = controller.fleet.weights.broadcaster
    assert isinstance(broadcaster.sender, RankZeroSender) and broadcaster.last_send_ms

    # resume: a new node agent, the same run folder, from the step-2 checkpoint
    info = latest_checkpoint(out)
    assert info is not None and info.step == 2
    node = _start_node(cluster_env, tmp_path / "node1-resumed.log")
    try:
        resumed = CheckingController(validate_spec(spec), out, progress=False, resume=info, rendezvous=cluster_env)
        result = _run(resumed)
        assert node.wait(timeout=60) == 0, (tmp_path / "node1-resumed.log").read_text()[-3000:]
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
    # The resumed run is a full two-node run, ZeRO-3 over the collective: steps 3-4 here.
    _assert_trained_on_both_nodes(resumed, result, STEPS, STEPS - info.step)
    assert isinstance(resumed.fleet.weights.broadcaster.sender, RankZeroSender)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "reward/mean" in line]
    assert sorted(set(steps)) == list(range(1, STEPS + 1)), steps  # no step missing
    record = json.loads((out / "resume.json").read_text())
    assert record["from_step"] == 2 and record["trainer_sha256"] == record["checkpoint_sha256"]
    assert all(e == record["trainer_sha256"] for e in record["engine_sha256"]) and len(record["engine_sha256"]) == 2
