"""The inference stage on GPU plans (resources.inference_gpu): where its workers (reward.model,
algorithm.kl_reference 'stage', critic.forward 'stage') compute, what the memory plan counts
for them there, and the refusals. Qwen2.5-0.5B's shape, bf16 at ZeRO 0 (autocast: fp32 weights)."""
import pytest

from workers.cluster.model_size import GIB, ModelSize
from workers.cluster.trainer_memory import inference_forward_gib
from workers.cluster.placement import Machine, PlacementError, plan_placement
from workers.spec import validate_spec

pytestmark = pytest.mark.distributed

QWEN_05B = ModelSize(494_032_768, hidden=896, intermediate=4864, layers=24, vocab=151_936)
FOUR = Machine(cpu_cores=8, gpus_per_node=4, gpu_memory_gib=80, visible_devices=("4", "5", "6", "7"))


def spec(inference_gpu="trainer", engines=2, colocate=False, share=0.8, **extra):
    return validate_spec({
        "name": "t", "model": {"path": "m", "dtype": "bfloat16"}, "task": {"dataset": "gen:add"},
        "algorithm": {"advantage": "gae", "kl_coef": 0.1, "kl_reference": "stage"}, "critic": {"forward": "stage"},
        "reward": {"function": "model", "model": {"path": "rm", "threads": 2}},
        "rollout": {"engines": engines}, "schedule": {"mode": "sync" if colocate else "async"},
        "resources": {"queue": "gpu", "inference_gpu": inference_gpu, "colocate": colocate,
                      "gpu_memory_utilization": share}, **extra})


def stages(plan):
    return [(p.name, p.node, p.gpus, p.cuda_visible_devices, p.threads) for p in plan.processes
            if p.role == "inference"]


@pytest.mark.parametrize("where, gpu", [("trainer", 0), ("engine", 1), ("own", 3)])
def test_every_inference_worker_computes_on_the_gpu_inference_gpu_names(where, gpu):
    plan = plan_placement(spec(where), FOUR, QWEN_05B)
    device = FOUR.device_id(gpu)  # through the inherited mask
    assert stages(plan) == [("reward model", 0, (gpu,), device, 2), ("KL reference stage", 0, (gpu,), device, 1),
                            ("critic stage", 0, (gpu,), device, 1)]
    assert plan.inference("critic stage").cuda_visible_devices == device
    assert [p.name for p in plan.trainers + plan.engines] == ["trainer 0", "engine 0", "engine 1"]
    assert f"KL reference stage: node 0, cores 0-7 (1 threads), CUDA_VISIBLE_DEVICES={device}" in plan.describe()


def test_a_run_without_an_inference_stage_places_none_and_a_cpu_plan_places_none():
    plain = validate_spec({"name": "t", "model": {"path": "m"}, "task": {"dataset": "gen:add"},
                           "resources": {"queue": "gpu"}})
    assert stages(plan_placement(plain, FOUR, QWEN_05B)) == []
    cpu = plan_placement(spec(), Machine(cpu_cores=2))
    assert cpu.device == "cpu" and stages(cpu) == [] and cpu.inference("reward model") is None


def test_own_needs_a_gpu_the_trainer_and_engines_leave():
    three = Machine(cpu_cores=8, gpus_per_node=3, gpu_memory_gib=80)
    with pytest.raises(PlacementError) as err:
        plan_placement(spec("own"), three, QWEN_05B)
    assert str(err.value) == (
        "resources.inference_gpu 'own': node 0 has 3 GPUs and the trainer and the engines take 3, so none is left "
        "for the inference stage (reward model, KL reference stage, critic stage); use 'trainer' or 'engine', or "
        "give the run one GPU more")
    # colocated, the engines sit on the trainer's GPU: the next one is free
    assert stages(plan_placement(spec("own", engines=1, colocate=True, share=0.5), three, QWEN_05B))[0][2] == (1,)


def test_the_trainer_gpu_counts_the_stages_models_and_forwards_and_the_trainer_no_reference():
    plan = plan_placement(spec("trainer"), FOUR, QWEN_05B)
    gpu0 = plan.memory.gpus[0]
    got = [(i.owner, i.what, round(i.gib, 3)) for i in gpu0.items if i.owner != "trainer rank 0"]
    fp32 = 494_032_768 * 4 / GIB  # autocast: the stages load fp32 weights, as the trainer does
    # one no-grad forward of 4096 tokens: a layer's values and the residual stream, 2 bytes each
    layer = 4096 * ((8 + 2) * 896 + 3 * 4864) * 2 / GIB
    logits = 4096 * 151_936 * (2 + 12) / GIB  # bf16 output, its fp32 copy, the scaled copy and the log-softmax
    assert got == [
        ("reward model", "CUDA context (estimated)", 0.8),
        ("reward model", "model (size unknown: not counted)", 0.0),  # no folder at "rm"
        ("KL reference stage", "CUDA context (estimated)", 0.8),
        ("KL reference stage", "reference model", round(fp32, 3)),
        ("KL reference stage", "a forward of 4096 tokens", round(layer + logits, 3)),
        ("critic stage", "CUDA context (estimated)", 0.8),
        ("critic stage", "critic's copy", round(fp32, 3)),
        ("critic stage", "a forward of 4096 tokens", round(layer, 3)),
    ]
    assert round(logits, 3) == 8.114  # Qwen2.5's vocabulary: what micro_batch_tokens bounds
    assert "KL reference model" not in [i.what for i in gpu0.items]  # the trainer holds none: the stage does
    assert [i.owner for i in plan.memory.gpus[1].items] == ["engine 0"]


def test_a_reward_model_of_known_size_is_counted_in_its_folders_dtype_and_top_p_adds_the_sort():
    rm = ModelSize(1_000_000_000, hidden=2048, intermediate=8192, layers=16, vocab=32_000, saved_dtype="bfloat16")
    run = spec("engine", share=0.5, rollout={"engines": 2, "top_p": 0.9})
    plan = plan_placement(run, FOUR, QWEN_05B)
    from workers.cluster.memory import plan_memory

    memory = plan_memory(run, plan, 80, QWEN_05B, rm)
    gpu1 = [(i.owner, i.what, round(i.gib, 3)) for i in memory.gpus[1].items]
    assert gpu1[0] == ("engine 0", "vLLM share (gpu_memory_utilization 0.5)", 40.0)
    assert ("reward model", "reward model", round(2e9 / GIB, 3)) in gpu1
    assert ("reward model", "a forward of 4096 tokens",
            round(4096 * (10 * 2048 + 3 * 8192) * 2 / GIB, 3)) in gpu1  # a score head: no vocabulary logits
    sorted_logits = 4096 * 151_936 * (2 + 12 + 12) / GIB
    assert round(inference_forward_gib(QWEN_05B, 4096, 2, logits=True, sort=True)
                 - inference_forward_gib(QWEN_05B, 4096, 2, logits=False, sort=False), 4) == round(sorted_logits, 4)


def test_an_engine_gpu_that_cannot_hold_the_stage_beside_vllms_share_names_what_lowers_it():
    run = spec("engine", share=0.85, inference={"micro_batch_tokens": 16384})
    with pytest.raises(PlacementError) as err:
        plan_placement(run, FOUR, QWEN_05B)
    text = str(err.value)
    assert text.startswith("resources: GPU 1 of node 0 needs ")
    assert "KL reference stage CUDA context (estimated) 0.8, reference model 1.8, a forward of 16384 tokens " \
           "33.2; critic stage" in text
    assert text.endswith("To fit: lower resources.gpu_memory_utilization; lower inference.micro_batch_tokens "
                         "(now 16384) or move the inference stage (resources.inference_gpu, now 'engine')")
    run.inference.micro_batch_tokens = 1024  # 2 GiB of logits: fits beside the share
    plan_placement(run, FOUR, QWEN_05B)


def test_the_fused_pipeline_is_refused_on_gpus_with_the_reason():
    import asyncio
    from types import SimpleNamespace

    from workers.coord.processes import Processes

    run = validate_spec({"name": "t", "model": {"path": "m"}, "task": {"dataset": "gen:add"},
                         "algorithm": {"advantage": "gae", "minibatches": 1}, "trainer": {"pipeline": {"stages": 2}},
                         "resources": {"queue": "gpu"}})
    processes = Processes(run, None, None, None)
    processes.plan = plan_placement(run, FOUR)
    with pytest.raises(PlacementError, match="passes each micro-batch's activations between its stage processes "
                                             "over gloo in host memory"):
        asyncio.run(processes.start_trainer(SimpleNamespace(pad_id=0)))  # the model check's result: only its pad id is read


def test_a_reward_models_size_is_its_score_heads_not_a_language_models():
    from pathlib import Path

    from transformers import AutoModelForSequenceClassification

    from workers.cluster.model_size import model_size

    folder = str(Path(__file__).resolve().parents[3] / "workers" / "assets" / "tiny-rm")
    size = model_size(folder, head="sequence-classification")
    loaded = AutoModelForSequenceClassification.from_pretrained(folder)
    assert size.params == sum(p.numel() for p in loaded.parameters())
    assert size.saved_dtype == "float32"  # its config's dtype: how the worker loads it
