"""workers/cluster/placement.py: exact plans for a few layouts, the refusals and their messages, the
spec's resources fields, and the CPU split the controller has always made."""
import pytest

from workers.cluster.placement import (Machine, ModelSize, PlacementError, Process, check_trainer_memory, format_cores,
                                       plan_cpu, plan_placement, trainer_memory)
from workers.spec import SpecError, validate_spec

BASE = {"name": "t", "model": {"path": "m"}, "task": {"dataset": "gen:add"}}


def spec(resources=None, engines=1, mode="async", **extra):
    return validate_spec({**BASE, "rollout": {"engines": engines}, "schedule": {"mode": mode},
                          "resources": resources or {}, **extra})


def summary(plan):
    """(name, node, CUDA_VISIBLE_DEVICES, gpus, memory share, cores) per process."""
    return [(p.name, p.node, p.cuda_visible_devices, p.gpus, p.gpu_memory_utilization, p.cpu_bind)
            for p in plan.processes]


# -- GPU layouts ----------------------------------------------------------------------------

def test_one_node_of_8_gpus_4_trainer_ranks_and_2_engines_of_tp2():
    plan = plan_placement(spec({"queue": "gpu", "gpus": 8, "trainer_ranks": 4, "tensor_parallel": 2}, engines=2),
                          Machine(cpu_cores=32, gpus_per_node=8, gpu_memory_gib=80))
    assert (plan.device, plan.nodes, plan.gpus_per_node, plan.colocate, plan.memory) == \
        ("gpu", 1, 8, False, None)  # no model folder at "m": memory not counted
    assert summary(plan) == [
        ("trainer 0", 0, "0,1,2,3", (0,), None, "0-5"),
        ("trainer 1", 0, "0,1,2,3", (1,), None, "6-11"),
        ("trainer 2", 0, "0,1,2,3", (2,), None, "12-16"),
        ("trainer 3", 0, "0,1,2,3", (3,), None, "17-21"),
        ("engine 0", 0, "4,5", (4, 5), 0.9, "22-26"),
        ("engine 1", 0, "6,7", (6, 7), 0.9, "27-31"),
    ]
    assert [p.local_rank for p in plan.trainers] == [0, 1, 2, 3]
    assert plan.env(plan.trainers[2]) == {"OMP_NUM_THREADS": "5", "CUDA_VISIBLE_DEVICES": "0,1,2,3", "RANK": "2",
                                          "LOCAL_RANK": "2", "WORLD_SIZE": "4"}
    assert plan.env(plan.engines[1]) == {"OMP_NUM_THREADS": "5", "CUDA_VISIBLE_DEVICES": "6,7"}
    assert "engine 1: node 0, cores 27-31 (5 threads), CUDA_VISIBLE_DEVICES=6,7" in plan.describe()


@pytest.mark.distributed  # `pytest -m distributed` covers the launch plan
def test_engines_are_processes_of_their_own_by_default_and_on_gpus_always():
    gpus = Machine(cpu_cores=8, gpus_per_node=2, gpu_memory_gib=80)
    assert plan_placement(spec({"queue": "gpu"}), gpus).engine_processes
    assert plan_placement(spec({"queue": "gpu", "engine_processes": True}), gpus).engine_processes
    with pytest.raises(PlacementError, match="engine_processes false on GPUs.*first visible GPU"):
        plan_placement(spec({"queue": "gpu", "engine_processes": False}), gpus)
    assert not plan_placement(spec({"queue": "gpu"}), gpus).engine_single_process(None)  # vLLM's own processes
    cpu = Machine(cpu_cores=8)
    default = plan_placement(spec(), cpu)
    # the one launch path: a server per engine, vLLM inside it (measured 1.12x the in-process engine, async)
    assert default.engine_processes and default.engine_single_process(None)
    assert not default.engine_single_process(False)  # the spec's setting wins
    inside = plan_placement(spec({"engine_processes": False}), cpu)  # the coordinator's process: not one lock
    assert not inside.engine_processes and not inside.engine_single_process(None)
    assert plan_placement(spec({"nodes": 2, "trainer_ranks": 2, "engine_processes": False}), cpu).engine_processes
    assert not plan_placement(spec({"tensor_parallel": 2}), cpu).engine_single_process(None)  # the mp executor


def test_two_nodes_of_8_gpus():
    # the 8 ranks fill node 0 and the 4 engines node 1: whole-node roles fit, so each role gets its node
    plan = plan_placement(spec({"queue": "gpu", "gpus": 16, "nodes": 2, "trainer_ranks": 8, "tensor_parallel": 2,
                                "gpu_memory_utilization": 0.85}, engines=4),
                          Machine(cpu_cores=12, gpus_per_node=8, gpu_memory_gib=80))
    assert (plan.nodes, plan.gpus_per_node) == (2, 8)
    rows = [(p.name, p.node, p.local_rank, p.cuda_visible_devices, p.gpu_memory_utilization, p.cpu_bind)
            for p in plan.processes]
    trainer_cores = ("0-1", "2-3", "4-5", "6-7", "8", "9", "10", "11")
    expected = [(f"trainer {j}", 0, j, "0,1,2,3,4,5,6,7", None, trainer_cores[j]) for j in range(8)]
    expected += [(f"engine {j}", 1, None, gpus, 0.85, cores)
                 for j, (gpus, cores) in enumerate((("0,1", "0-2"), ("2,3", "3-5"), ("4,5", "6-8"), ("6,7", "9-11")))]
    assert rows == expected
    assert [p.name for p in plan.on_node(1, "engine")] == ["engine 0", "engine 1", "engine 2", "engine 3"]
    assert plan.env(plan.trainers[5])["RANK"] == "5" and plan.env(plan.trainers[5])["LOCAL_RANK"] == "5"
    assert plan.node_roles() == ["  node 0: trainer ranks 0-7", "  node 1: engines 0-3"]
    # 12 ranks need both nodes, leaving none to the engines: the even split
    even = plan_placement(spec({"queue": "gpu", "gpus": 16, "nodes": 2, "trainer_ranks": 12}, engines=2),
                          Machine(cpu_cores=12, gpus_per_node=8, gpu_memory_gib=80))
    assert even.node_roles() == ["  nodes 0-1: trainer ranks 0-11 (6 a node); engines 0-1 (1 a node)"]


def test_colocated_engines_share_the_trainer_gpus_and_sleep_through_its_steps():
    plan = plan_placement(spec({"queue": "gpu", "gpus": 4, "trainer_ranks": 4, "tensor_parallel": 2,
                                "colocate": True}, engines=2, mode="sync"),
                          Machine(cpu_cores=6, gpus_per_node=4, gpu_memory_gib=80), ModelSize(10**8))
    assert (plan.colocate, plan.overlapped, plan.sleeps) == (True, False, True)
    assert "colocated engines sleep while the trainer steps" in plan.describe()
    assert summary(plan) == [
        ("trainer 0", 0, "0,1,2,3", (0,), None, "0"),
        ("trainer 1", 0, "0,1,2,3", (1,), None, "1"),
        ("trainer 2", 0, "0,1,2,3", (2,), None, "2"),
        ("trainer 3", 0, "0,1,2,3", (3,), None, "3"),
        ("engine 0", 0, "0,1", (0, 1), 0.5, "4"),
        ("engine 1", 0, "2,3", (2, 3), 0.5, "5"),
    ]


def test_the_weight_groups_backend_is_nccl_only_when_every_member_has_a_gpu_of_its_own():
    eight = Machine(cpu_cores=32, gpus_per_node=8, gpu_memory_gib=80)
    apart = plan_placement(spec({"queue": "gpu", "gpus": 8, "trainer_ranks": 4, "tensor_parallel": 2}, engines=2),
                           eight)
    assert apart.weight_backend == "nccl"  # trainer rank 0 on GPU 0, engine workers on 4-7
    shared = plan_placement(spec({"queue": "gpu", "gpus": 4, "trainer_ranks": 4, "tensor_parallel": 2,
                                  "colocate": True}, engines=2, mode="sync"), eight, ModelSize(10**8))
    assert shared.weight_backend == "gloo"  # engine 0's first worker is on trainer rank 0's GPU
    one = plan_placement(spec({"queue": "gpu", "gpus": 1, "colocate": True}, mode="sync"),
                         Machine(cpu_cores=4, gpus_per_node=1, gpu_memory_gib=80), ModelSize(10**8))
    assert one.weight_backend == "gloo"  # a single GPU: NCCL would refuse the duplicate device
    assert plan_placement(spec(), Machine(cpu_cores=8)).weight_backend == "gloo"


def test_an_old_spec_with_gpus_alone_is_one_node_with_that_many():
    plan = plan_placement(spec({"queue": "gpu", "gpus": 2}), Machine(cpu_cores=4, gpus_per_node=8))
    assert (plan.nodes, plan.gpus_per_node) == (1, 2)
    assert summary(plan) == [("trainer 0", 0, "0", (0,), None, "0-1"), ("engine 0", 0, "1", (1,), 0.9, "2-3")]
    # no count at all: what the machine has
    assert plan_placement(spec({"queue": "gpu"}), Machine(cpu_cores=4, gpus_per_node=8)).gpus_per_node == 8


# -- CPU layouts (the controller's split) ----------------------------------------------------

def test_cpu_2_cores_async_halves_and_sync_gives_each_phase_the_machine():
    two = Machine(cpu_cores=2)
    plan = plan_placement(spec(mode="async"), two)
    assert (plan.device, plan.overlapped) == ("cpu", True)
    assert [(p.name, p.cpu_cores, p.threads, p.cuda_visible_devices) for p in plan.processes] == \
        [("trainer 0", (1,), 1, None), ("engine 0", (0,), 1, None)]
    assert plan.env(plan.engines[0]) == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    plan = plan_placement(spec(mode="sync"), two)
    assert [(p.name, p.cpu_bind, p.threads) for p in plan.processes] == \
        [("trainer 0", "0-1", 2), ("engine 0", "0-1", 2)]
    stream = plan_placement(spec(schedule={"mode": "sync", "stream_train": True}), two)
    assert stream.overlapped and stream.cpu_bind("engine") == "0" and stream.threads("trainer") == 1


def test_cpu_overlap_shared_gives_both_overlapped_roles_every_core_waiting_passively():
    two = Machine(cpu_cores=2)
    plan = plan_placement(spec({"cpu_overlap": "shared"}, mode="async"), two)
    assert plan.overlapped and plan.shared_cores
    assert [(p.name, p.cpu_bind, p.threads) for p in plan.processes] == \
        [("trainer 0", "0-1", 2), ("engine 0", "0-1", 2)]
    assert plan.env(plan.engines[0]) == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE",
                                         "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    # a sync schedule gives each phase the machine anyway: nothing overlaps, nothing to share
    sync = plan_placement(spec({"cpu_overlap": "shared"}, mode="sync"), two)
    assert not sync.shared_cores and "OMP_WAIT_POLICY" not in sync.env(sync.engines[0])


def test_cpu_16_cores_2_engines_2_ranks():
    sixteen = Machine(cpu_cores=16)
    plan = plan_placement(spec({"trainer_ranks": 2}, engines=2), sixteen)
    assert [(p.name, p.cpu_bind, p.threads) for p in plan.processes] == [
        ("trainer 0", "8-11", 4), ("trainer 1", "12-15", 4), ("engine 0", "0-3", 4), ("engine 1", "4-7", 4)]
    assert (plan.cpu_bind("engine"), plan.threads("trainer")) == ("0-7", 8)
    plan = plan_placement(spec({"trainer_ranks": 2}, engines=2, mode="sync"), sixteen)
    assert [(p.name, p.cpu_bind) for p in plan.processes] == [
        ("trainer 0", "0-7"), ("trainer 1", "8-15"), ("engine 0", "0-7"), ("engine 1", "8-15")]


def test_more_engines_than_cores_share_them():
    plan = plan_placement(spec(engines=3), Machine(cpu_cores=4))
    assert [p.cpu_bind for p in plan.engines] == ["0-1"] * 3 and plan.trainers[0].cpu_bind == "2-3"


def _old_cpu_split(cores, overlapped):
    """Controller._cpu_split before the planner, verbatim."""
    if not overlapped or cores < 2:
        return f"0-{cores - 1}" if cores > 1 else "0", cores
    half = max(1, cores // 2)
    return (f"0-{half - 1}" if half > 1 else "0"), cores - half


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_controller_split_is_what_it_was(mode, monkeypatch):
    import workers.coord.controller as controller
    from types import SimpleNamespace

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    for engines in (1, 2, 3):
        run = SimpleNamespace(spec=spec(engines=engines, mode=mode))
        for cores in (1, 2, 3, 4, 7, 16, 64):
            monkeypatch.setattr(controller.os, "cpu_count", lambda: cores)
            plan = controller.Controller._placement(run)
            assert (plan.cpu_bind("engine"), plan.threads("trainer")) == _old_cpu_split(cores, mode == "async"), \
                (engines, cores)


def test_format_cores():
    assert format_cores([]) == "" and format_cores([3]) == "3"
    assert format_cores([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"


# -- refusals -------------------------------------------------------------------------------

def refused(resources, machine, engines=1, mode="async") -> str:
    with pytest.raises(PlacementError) as err:
        plan_placement(spec(resources, engines=engines, mode=mode), machine)
    return str(err.value)


FOUR = Machine(cpu_cores=8, gpus_per_node=4, gpu_memory_gib=80)


def test_too_many_gpus_on_a_node_names_the_count():
    assert refused({"trainer_ranks": 4}, FOUR, engines=2).startswith(
        "resources: needs 6 GPUs on node 0 (trainer 4 + engines 2x1), the node has 4;")
    assert refused({"trainer_ranks": 2, "tensor_parallel": 2, "colocate": True}, FOUR, engines=3, mode="sync") \
        .startswith("resources: needs 6 GPUs on node 0 (colocated: trainer 2 and engines 3x2 share them), "
                    "the node has 4")
    # a spec's own gpus cap the node below what the machine has
    assert refused({"gpus": 2, "trainer_ranks": 2}, FOUR).startswith("resources: needs 3 GPUs on node 0")


def test_a_cpu_plan_refuses_colocation_since_vllm_sleeps_only_on_gpus():
    assert refused({"colocate": True}, Machine(cpu_cores=2), mode="sync") == (
        "resources.colocate: colocated engines sleep while the trainer steps, and vLLM has sleep mode only on GPUs "
        "(CUDA, ROCm, XPU); on a CPU, schedule.mode 'sync' already gives each phase the whole machine: leave it out")
    assert not plan_placement(spec(mode="sync"), Machine(cpu_cores=2)).sleeps


def test_more_gpus_than_the_machine_has():
    assert refused({"gpus": 8}, FOUR) == "resources.gpus: the run asks for 8 GPUs, the machine has 4"
    assert refused({"gpus": 16, "nodes": 2}, FOUR) == \
        "resources.gpus: the run asks for 16 GPUs, 8 per node, the machine has 4 per node"
    assert refused({"gpus_per_node": 8}, FOUR) == \
        "resources.gpus_per_node: the run asks for 8 GPUs per node, the machine has 4"


def test_tensor_parallel_larger_than_a_node():
    assert refused({"tensor_parallel": 8}, FOUR) == \
        "resources.tensor_parallel: an engine needs 8 GPUs on one node, a node has 4 (an engine does not span nodes)"


def test_trainer_ranks_must_divide_over_nodes():
    message = "resources.trainer_ranks: {} trainer rank(s) do not divide evenly over 2 nodes (resources.nodes)"
    assert refused({"nodes": 2, "trainer_ranks": 3}, Machine(cpu_cores=8)) == message.format(3)
    # on GPUs 3 ranks take node 0 whole and the engine node 1; 5 need both nodes, split evenly
    assert [(p.name, p.node) for p in plan_placement(spec({"nodes": 2, "trainer_ranks": 3}), FOUR).processes] == [
        ("trainer 0", 0), ("trainer 1", 0), ("trainer 2", 0), ("engine 0", 1)]
    assert refused({"nodes": 2, "trainer_ranks": 5}, FOUR) == message.format(5)


def test_gpus_asked_of_a_machine_without_any():
    assert refused({"queue": "gpu", "gpus": 2}, Machine(cpu_cores=8)) == \
        "resources.gpus: the run asks for 2 GPU(s), the machine has none"
    # the controller's CPU path does not read GPU counts (older specs ran on CPU with them)
    assert plan_cpu(spec({"gpus": 2}), Machine(cpu_cores=2)).device == "cpu"


@pytest.mark.distributed  # `pytest -m distributed` covers the launch plan
def test_tensor_parallel_on_the_cpu_splits_an_engines_cores_among_its_shards():
    eight = Machine(cpu_cores=8)
    plan = plan_placement(spec({"tensor_parallel": 2}, engines=2), eight)  # async: cores 0-3 generate
    assert (plan.tensor_parallel, plan.engine_processes) == (2, True)  # vLLM's workers: processes of their own
    assert [plan.env(p)["VLLM_CPU_OMP_THREADS_BIND"] for p in plan.engines] == ["0|1", "2|3"]
    one_core = plan_placement(spec({"tensor_parallel": 2}), Machine(cpu_cores=2))  # async: core 0 generates
    assert plan.env(one_core.engines[0])["VLLM_CPU_OMP_THREADS_BIND"] == "0|0"  # both shards share it
    assert refused({"tensor_parallel": 2, "engine_processes": False}, eight) == (
        "resources.tensor_parallel: 2 shards an engine over 2 worker processes of vLLM's own (its mp executor), "
        "which an engine inside the coordinator's process cannot have: leave resources.engine_processes and "
        "rollout.cpu_single_process out")


# -- trainer memory -------------------------------------------------------------------------

def test_trainer_memory_by_zero_stage():
    params = 2**30  # so bytes per parameter read as GiB
    # fp32: 4 + 4 + 8, and AdamW's temporaries at the step, 4
    assert trainer_memory(params, "float32", 0, 8).total_gib == 20
    # ZeRO 0 trains bfloat16 under autocast: fp32 4 + 4 + 8; AdamW's 4 outgrow the forward's bf16 weight copies 2
    assert trainer_memory(params, "bfloat16", 0, 8).total_gib == 20
    mem = trainer_memory(params, "bfloat16", 3, 4)
    # gradients accumulate in fp32 (data_types.grad_accum_dtype)
    assert (mem.weights_gib, mem.gradients_gib, mem.optimizer_gib) == (0.5, 1.0, 3.0)
    # fp32 gradient partition and AdamW's temporaries at the step 1.0 + 1.0, the full weights gathered for a
    # weight sync 2.0: the larger counts
    assert (mem.step_gib, mem.gather_gib, mem.total_gib) == (2.0, 2.0, 6.5)
    assert trainer_memory(params, "bfloat16", 1, 4).total_gib == 2 + (2 + 4) + 3 + 1


def test_check_trainer_memory_refuses_what_does_not_fit():
    machine = Machine(cpu_cores=8, gpus_per_node=8, gpu_memory_gib=80)
    big = spec({"queue": "gpu", "trainer_ranks": 4}, model={"path": "m", "dtype": "bfloat16"})
    with pytest.raises(PlacementError, match=r"^resources: GPU 0 of node 0 needs 131.8 GiB, it has 80.0: trainer rank "
                                             r"0 CUDA context and runtime buffers \(measured\) 1.4, weights 26.1, .* To fit: raise trainer.zero_stage \(now 0\) or "
                                             r"resources.trainer_ranks \(now 4\)$"):
        check_trainer_memory(big, plan_placement(big, machine), machine, params=7 * 10**9)
    sharded = spec({"queue": "gpu", "trainer_ranks": 4}, model={"path": "m", "dtype": "bfloat16"},
                   trainer={"zero_stage": 3})
    assert round(check_trainer_memory(sharded, plan_placement(sharded, machine), machine, 7 * 10**9).total_gib, 2) \
        == 42.38  # 3.26 + 6.52 + 19.56 + 13.04 (the full weights gathered for a weight sync)
    colocated = spec({"queue": "gpu", "trainer_ranks": 4, "colocate": True}, mode="sync",
                     model={"path": "m", "dtype": "bfloat16"}, trainer={"zero_stage": 3})
    # while the engine generates: the trainer's states beside its share (the step's transients come when it sleeps)
    with pytest.raises(PlacementError, match=r"^resources: GPU 0 of node 0 needs 101.4 GiB while the engines generate, "
                                             r"it has 80.0: .*; engine 0 vLLM share \(gpu_memory_utilization 0.5\) "
                                             r"40.0\. The largest is engine 0's vLLM share"):
        check_trainer_memory(colocated, plan_placement(colocated, machine, ModelSize(10**8)), machine, 14 * 10**9)


# -- the spec's resources fields ------------------------------------------------------------

def spec_errors(resources, **extra) -> list[dict]:
    with pytest.raises(SpecError) as err:
        validate_spec({**BASE, "resources": resources, **extra})
    return err.value.errors


def test_resources_defaults_keep_old_specs_valid():
    res = validate_spec({**BASE, "resources": {"queue": "gpu", "gpus": 4}}).resources
    assert (res.queue, res.gpus, res.nodes, res.gpus_per_node, res.trainer_ranks, res.tensor_parallel,
            res.gpu_memory_utilization, res.colocate) == ("gpu", 4, 1, None, 1, 1, None, False)


def test_unknown_resources_field_is_refused_by_name():
    assert spec_errors({"rollout": {"engines": 2}}) == [{"field": "resources.rollout", "message": "unknown field"}]
    assert spec_errors({"tensor_paralel": 2}) == [{"field": "resources.tensor_paralel", "message": "unknown field"}]


def test_bad_resources_values_name_their_field():
    assert [e["field"] for e in spec_errors({"gpu_memory_utilization": 1.5})] == ["resources.gpu_memory_utilization"]
    assert [e["field"] for e in spec_errors({"trainer_ranks": 0, "nodes": 0})] == \
        ["resources.nodes", "resources.trainer_ranks"]
    assert spec_errors({"gpus": 6, "nodes": 4}) == [
        {"field": "resources.nodes", "message": "resources.gpus (6) do not split evenly over 4 nodes"}]
    assert spec_errors({"gpus": 8, "nodes": 2, "gpus_per_node": 2}) == [
        {"field": "resources.gpus_per_node",
         "message": "resources.gpus is 8 but nodes x gpus_per_node is 2 x 2 = 4: give one of them, or make them agree"}]
    validate_spec({**BASE, "resources": {"gpus": 8, "nodes": 2, "gpus_per_node": 4}})


def test_colocate_is_taken_in_both_modes():
    assert validate_spec({**BASE, "resources": {"colocate": True}, "schedule": {"mode": "sync"}}).resources.colocate
    assert validate_spec({**BASE, "resources": {"colocate": True}, "schedule": {"mode": "async"}}).resources.colocate


def test_process_is_a_plain_record():
    p = Process("engine", 0, 0, (0, 1), 2)
    assert (p.name, p.cpu_bind, p.gpus, p.cuda_visible_devices) == ("engine 0", "0-1", (), None)


# -- an inherited CUDA_VISIBLE_DEVICES --------------------------------------------------------

def test_plan_ids_map_through_an_inherited_mask():
    masked = Machine(cpu_cores=8, gpus_per_node=4, gpu_memory_gib=80, visible_devices=("4", "5", "6", "7"))
    plan = plan_placement(spec({"queue": "gpu", "trainer_ranks": 2, "tensor_parallel": 2}), masked)
    assert [(p.name, p.gpus, p.cuda_devices, p.cuda_visible_devices) for p in plan.processes] == [
        ("trainer 0", (0,), ("4",), "4,5"),
        ("trainer 1", (1,), ("5",), "4,5"),
        ("engine 0", (2, 3), ("6", "7"), "6,7"),
    ]
    assert plan.env(plan.trainers[1]) == {"OMP_NUM_THREADS": "3", "CUDA_VISIBLE_DEVICES": "4,5", "RANK": "1",
                                          "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    assert plan.env(plan.engines[0]) == {"OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": "6,7"}
    # without a mask the ids are the devices' own
    plain = plan_placement(spec({"queue": "gpu", "trainer_ranks": 2, "tensor_parallel": 2}),
                           Machine(cpu_cores=8, gpus_per_node=4, gpu_memory_gib=80))
    assert [p.cuda_visible_devices for p in plain.processes] == ["0,1", "0,1", "2,3"]
    assert [p.cuda_devices for p in plain.processes] == [("0",), ("1",), ("2", "3")]


def test_a_mask_of_gpu_uuids_and_one_of_two_nodes():
    uuids = ("GPU-8f6c2a1e-0000-0000-0000-000000000001", "GPU-8f6c2a1e-0000-0000-0000-000000000002")
    plan = plan_placement(spec({"queue": "gpu", "nodes": 2, "gpus_per_node": 2, "trainer_ranks": 2}, engines=2),
                          Machine(cpu_cores=4, gpus_per_node=2, gpu_memory_gib=80, visible_devices=uuids))
    # whole-node roles: the two ranks on node 0, the two engines on node 1
    assert [(p.name, p.node, p.cuda_visible_devices) for p in plan.processes] == [
        ("trainer 0", 0, ",".join(uuids)), ("trainer 1", 0, ",".join(uuids)), ("engine 0", 1, uuids[0]),
        ("engine 1", 1, uuids[1])]
    assert plan.env(plan.engines[1])["CUDA_VISIBLE_DEVICES"] == uuids[1]


def test_inherited_mask_reads_cuda_visible_devices_as_cuda_does():
    from workers.cluster.placement import inherited_mask

    assert inherited_mask({}) is None
    assert inherited_mask({"CUDA_VISIBLE_DEVICES": ""}) == ()
    assert inherited_mask({"CUDA_VISIBLE_DEVICES": "4,5, 6"}) == ("4", "5", "6")
    assert inherited_mask({"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == ("0",)  # -1 hides what follows
    assert inherited_mask({"CUDA_VISIBLE_DEVICES": "GPU-1a2b,MIG-3c4d"}) == ("GPU-1a2b", "MIG-3c4d")
    with pytest.raises(ValueError):  # a mask shorter than the GPUs it should name
        Machine(cpu_cores=1, gpus_per_node=2, visible_devices=("3",))


def test_detect_machine_counts_only_the_visible_gpus(monkeypatch):
    from types import SimpleNamespace

    from workers.cluster.placement import detect_machine

    monkeypatch.setattr("os.cpu_count", lambda: 16)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 8)
    monkeypatch.setattr("torch.cuda.get_device_properties", lambda i: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr("workers.cluster.placement.host_memory_gib", lambda: 0.0)
    assert detect_machine({"CUDA_VISIBLE_DEVICES": "4,5"}) == \
        Machine(cpu_cores=16, gpus_per_node=2, gpu_memory_gib=80.0, visible_devices=("4", "5"))
    assert detect_machine({}) == Machine(cpu_cores=16, gpus_per_node=8, gpu_memory_gib=80.0)
    # set to nothing: no GPU, and a CPU plan
    assert detect_machine({"CUDA_VISIBLE_DEVICES": ""}) == Machine(cpu_cores=16, visible_devices=())
    assert plan_placement(spec(), detect_machine({"CUDA_VISIBLE_DEVICES": ""})).device == "cpu"
