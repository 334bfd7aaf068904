"""Every process the plan places starts with the plan's environment, read back from
/proc/<pid>/environ (what the process was exec'd with, not what it set later): each
engine server and each trainer rank, through the launchers a run uses
(Processes.engine_config + launch_server, Processes.start_trainer). Under an
inherited mask (CUDA_VISIBLE_DEVICES=4,5,6,7, as Slurm or Docker --gpus leave it) the
plan's logical GPUs reach the processes as the physical ids behind them. The plan is a
GPU plan for a machine described to the planner; on this CPU the processes run on their
cores, with the same launch code. (vLLM's own processes inherit the server's environment
when it starts them; they rename themselves, "VLLM::EngineCore", and setproctitle writes
over the memory /proc/<pid>/environ reads, so theirs cannot be read back this way.)"""
import asyncio
import os
from types import SimpleNamespace

import pytest

from workers.cluster.placement import Machine, inherited_mask, plan_gpu
from workers.coord.processes import Processes
from workers.rollout.client import kill_session, launch_server
from workers.spec import validate_spec

pytestmark = [pytest.mark.engine, pytest.mark.distributed, pytest.mark.timeout(600)]


def environ(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def test_engine_servers_and_trainer_ranks_start_with_the_plans_environment_under_a_mask(
        monkeypatch, tmp_path, tiny_model_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    machine = Machine(cpu_cores=4, gpus_per_node=4, gpu_memory_gib=80, visible_devices=inherited_mask())
    spec = validate_spec({"name": "env", "model": {"path": tiny_model_path}, "task": {"dataset": "gen:add"},
                          "resources": {"queue": "gpu", "trainer_ranks": 2, "engine_processes": True}})
    plan = plan_gpu(spec, machine)
    [engine] = plan.engines
    assert plan.env(engine)["CUDA_VISIBLE_DEVICES"] == "6"  # logical GPU 2 behind the mask
    assert [plan.env(t)["CUDA_VISIBLE_DEVICES"] for t in plan.trainers] == ["4,5", "4,5"]

    processes = Processes(spec, tmp_path, None, lambda error: None)
    processes.plan = plan
    checked = SimpleNamespace(pad_id=0, max_model_len=256, stop_ids=[2])
    lent = set(plan.env(engine)) | {k for t in plan.trainers for k in plan.env(t)} | {"MASTER_ADDR", "MASTER_PORT"}
    before = {k: os.environ.get(k) for k in lent}
    # the server process as a run starts it (EngineClient.start launches it so, then starts vLLM in it)
    proc, _, pid = launch_server(processes.engine_config(engine, checked))
    try:
        env = environ(pid)
        assert {k: env.get(k) for k in plan.env(engine)} == plan.env(engine)
        group = asyncio.run(processes.start_trainer(checked))
        try:
            assert len(group.pids) == 2
            for rank, rank_pid in zip(plan.trainers, group.pids):
                env = environ(rank_pid)
                assert {k: env.get(k) for k in plan.env(rank)} == plan.env(rank), rank.name
                assert env["MASTER_ADDR"] == "127.0.0.1"
        finally:
            group.close()
    finally:
        kill_session(proc.pid)
        proc.wait()
    # the coordinator's own environment is as it was: the launch lent it for the exec only
    assert {k: os.environ.get(k) for k in lent} == before
