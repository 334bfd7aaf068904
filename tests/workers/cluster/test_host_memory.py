"""The host-memory plan of CPU plans (workers/cluster/host_memory.py): what each process holds,
named as result.json's memory_peak_gib names it, and the refusal of a plan the machine cannot
hold. Qwen2.5-0.5B's shape."""
import pytest

from workers.cluster.host_memory import (COORDINATOR_RUNTIME_GIB, ENGINE_SERVER_RUNTIME_GIB,
                                         INFERENCE_WORKER_RUNTIME_GIB, TRAINER_RUNTIME_GIB, VLLM_CORE_RUNTIME_GIB)
from workers.cluster.model_size import GIB, ModelSize
from workers.cluster.placement import Machine, PlacementError, plan_placement
from workers.spec import validate_spec

QWEN_05B = ModelSize(494_032_768, hidden=896, intermediate=4864, layers=24, vocab=151_936, heads=14, kv_hidden=128,
                     family="gated")
P = 494_032_768 / GIB  # GiB per byte of each parameter


def spec(dtype="bfloat16", **extra):
    base = {"name": "t", "model": {"path": "m", "dtype": dtype}, "task": {"dataset": "gen:add"},
            "trainer": {"micro_batch_tokens": 1024}, "schedule": {"mode": "sync"},
            "rollout": {"max_model_len": 256}}  # as examples/own-model/real-size.yaml
    for key, value in extra.items():
        base[key] = {**base.get(key, {}), **value}
    return validate_spec(base)


def items(plan, name):
    load = next(p for p in plan.host_memory.processes if p.name == name)
    return {i.what: round(i.gib, 3) for i in load.items}


def test_the_real_size_example_plans_each_process_item_by_item():
    plan = plan_placement(spec(), Machine(cpu_cores=2, host_memory_gib=23.6), QWEN_05B)
    assert [p.name for p in plan.host_memory.processes] == ["coordinator", "engine 0 server", "engine 0 vLLM core"]
    # bf16 at ZeRO 0 is autocast: fp32 weights, gradients and Adam states; the forward of 1024
    # tokens keeps autocast's bf16 weight copies (2 P), per token 24 layers x (34 h + 8 i + 4 heads
    # + 8 bytes, and the padding mask, 2 bytes x 256 positions: no row is longer than max_model_len),
    # the ids and the final norm (8 + 8 h + 4), and the logits at 151,936 x 24 bytes a token
    layer = 34 * 896 + 8 * 4864 + 4 * 14 + 8 + 2 * 256
    forward = 2 * P + 1024 * (24 * layer + 8 + 8 * 896 + 4) / GIB + 1024 * 151_936 * 24 / GIB
    assert items(plan, "coordinator") == {
        "runtime (measured)": COORDINATOR_RUNTIME_GIB, "trainer runtime (measured)": TRAINER_RUNTIME_GIB,
        "weights": round(4 * P, 3), "gradients": round(4 * P, 3), "Adam states": round(8 * P, 3),
        "a micro-batch's forward": round(forward, 3)}
    assert round(forward, 2) == 6.01
    assert items(plan, "engine 0 server") == {"runtime (measured)": ENGINE_SERVER_RUNTIME_GIB}
    assert items(plan, "engine 0 vLLM core") == {
        "vLLM runtime (measured)": VLLM_CORE_RUNTIME_GIB, "KV cache (VLLM_CPU_KVCACHE_SPACE)": 1.0,
        "weights, as loaded": round(2 * 2 * P, 3), "the first weight update's copy": round(2 * 2 * P, 3)}
    assert plan.host_memory.by_process() == {"coordinator": 14.14, "engine 0 server": 0.71,
                                             "engine 0 vLLM core": 5.5}
    described = plan.describe()
    assert "coordinator: 14.1 GiB of host memory (runtime (measured) 0.53" in described
    assert "node 0: 20.3 of 23.6 GiB planned in all" in described


def test_a_plan_the_machine_cannot_hold_is_refused_naming_each_process_and_what_lowers_it(monkeypatch):
    monkeypatch.delenv("FLUXRL_SKIP_HOST_MEMORY_CHECK", raising=False)
    small = Machine(cpu_cores=2, host_memory_gib=16.0)
    with pytest.raises(PlacementError) as err:
        plan_placement(spec("float32"), small, QWEN_05B)
    message = str(err.value)
    assert message.startswith("resources: node 0's processes need 24.0 GiB of host memory, it has 16.0 "
                              "(coordinator 14.1; engine 0 server 0.7; engine 0 vLLM core 9.2). The largest item is "
                              "coordinator's a micro-batch's forward (6.0).")
    assert "set model.dtype bfloat16" in message and "lower trainer.micro_batch_tokens (now 1024)" in message
    assert "FLUXRL_SKIP_HOST_MEMORY_CHECK=1" in message
    monkeypatch.setenv("FLUXRL_SKIP_HOST_MEMORY_CHECK", "1")
    assert plan_placement(spec("float32"), small, QWEN_05B).host_memory.node_total_gib(0) == pytest.approx(24.0, abs=0.05)


def test_unknown_memory_or_model_size_plans_without_refusing():
    assert plan_placement(spec("float32"), Machine(cpu_cores=2), QWEN_05B).host_memory.problem() is None
    assert plan_placement(spec(), Machine(cpu_cores=2, host_memory_gib=1.0)).host_memory is None  # "m": no folder


def test_trainer_ranks_in_processes_of_their_own_each_hold_their_zero_partition():
    plan = plan_placement(spec(trainer={"zero_stage": 2}, resources={"trainer_ranks": 2}),
                          Machine(cpu_cores=4), QWEN_05B)
    names = [p.name for p in plan.host_memory.processes]
    assert names == ["coordinator", "trainer rank 0", "trainer rank 1", "engine 0 server", "engine 0 vLLM core"]
    assert items(plan, "coordinator") == {"runtime (measured)": COORDINATOR_RUNTIME_GIB}
    rank = items(plan, "trainer rank 1")
    # DeepSpeed's bf16 mode at ZeRO 2: bf16 weights, the fp32 gradient, master and moments partitions
    assert rank["runtime (measured)"] == round(COORDINATOR_RUNTIME_GIB + TRAINER_RUNTIME_GIB, 3)
    assert (rank["weights"], rank["gradients"], rank["fp32 master weights and Adam states"]) == (
        round(2 * P, 3), round(2 * P, 3), round(6 * P, 3))


def test_engines_inside_the_coordinator_have_no_server_and_a_bigger_kv_cache_counts():
    plan = plan_placement(spec(resources={"engine_processes": False}, rollout={"kv_cache_gb": 2.6, "engines": 2}),
                          Machine(cpu_cores=2), QWEN_05B)
    assert [p.name for p in plan.host_memory.processes] == ["coordinator", "engine 0 vLLM core", "engine 1 vLLM core"]
    assert items(plan, "engine 1 vLLM core")["KV cache (VLLM_CPU_KVCACHE_SPACE)"] == 3.0  # vLLM's whole GiB


def test_the_inference_stage_workers_are_planned_under_the_names_the_run_measures():
    plan = plan_placement(spec(algorithm={"kl_coef": 0.1, "kl_reference": "stage", "advantage": "gae"},
                               critic={"forward": "stage"}), Machine(cpu_cores=2), QWEN_05B)
    names = [p.name for p in plan.host_memory.processes]
    assert names[-2:] == ["KL reference stage", "critic stage"]
    reference = items(plan, "KL reference stage")
    assert reference["runtime (measured)"] == INFERENCE_WORKER_RUNTIME_GIB
    assert reference["reference model"] == round(4 * P, 3)  # as the trainer loads it: fp32 under autocast
    # the trainer holds no reference of its own, and trains the critic beside the policy
    assert "KL reference model" not in items(plan, "coordinator")
    assert items(plan, "coordinator")["critic's weights, gradients and optimizer states"] == round(16 * P, 3)


def test_this_machines_memory_is_read_from_proc_meminfo():
    from workers.cluster.host_memory import host_memory_gib
    from workers.cluster.placement import detect_machine

    with open("/proc/meminfo") as fh:
        total_kib = int(next(line for line in fh if line.startswith("MemTotal:")).split()[1])
    assert host_memory_gib() == round(total_kib / 2**20, 1) > 0
    assert detect_machine({"CUDA_VISIBLE_DEVICES": ""}).host_memory_gib == host_memory_gib()
