"""workers/cluster/memory.py through the planner: what each GPU of a plan holds, the runs
refused before anything starts and their exact messages (GiB = 2**30 bytes; 7e9 bf16
parameters are 13.04 GiB)."""
import json

import pytest

from workers.cluster.model_size import ModelSize, model_size
from workers.cluster.trainer_memory import trainer_memory
from workers.cluster.placement import Machine, PlacementError, plan_placement
from workers.spec import validate_spec

pytestmark = pytest.mark.distributed  # the planner's refusals are part of `pytest -m distributed`

SEVEN_B = ModelSize(7 * 10**9)
ONE = Machine(cpu_cores=8, gpus_per_node=1, gpu_memory_gib=80)
TWO = Machine(cpu_cores=8, gpus_per_node=2, gpu_memory_gib=80)
TWO_94 = Machine(cpu_cores=8, gpus_per_node=2, gpu_memory_gib=94)  # H100 NVL
FOUR = Machine(cpu_cores=8, gpus_per_node=4, gpu_memory_gib=80)


def spec(resources, engines=1, mode="sync", rollout=None, path="m", **extra):
    return validate_spec({"name": "t", "model": {"path": path, "dtype": "bfloat16"}, "task": {"dataset": "gen:add"},
                          "rollout": {"engines": engines, **(rollout or {})}, "schedule": {"mode": mode},
                          "resources": {"queue": "gpu", **resources}, **extra})


def refused(run, machine, model=SEVEN_B) -> str:
    with pytest.raises(PlacementError) as err:
        plan_placement(run, machine, model)
    return str(err.value)


COLOCATED_ZERO3 = {"gpus": 2, "trainer_ranks": 2, "tensor_parallel": 2, "colocate": True,
                   "gpu_memory_utilization": 0.1}


def test_7b_bf16_on_one_80gb_gpu_colocated_with_an_engine_is_refused():
    # ZeRO 0 in bfloat16 trains under autocast: fp32 weights, gradients and Adam states (16 bytes a parameter);
    # while the engine generates, they sit beside its share (the autocast copies come only in the step)
    assert refused(spec({"gpus": 1, "colocate": True}), ONE) == (
        "resources: GPU 0 of node 0 needs 145.7 GiB while the engines generate, it has 80.0: trainer rank 0 "
        "CUDA context and runtime buffers (measured) 1.4, weights 26.1, gradients 26.1, Adam states 52.2; engine 0 vLLM share (gpu_memory_utilization 0.5) 40.0. "
        "The largest is trainer rank 0's Adam states. To fit: raise trainer.zero_stage (now 0) or "
        "resources.trainer_ranks (now 1); lower resources.gpu_memory_utilization, or set resources.colocate false")


def test_the_same_split_over_2_gpus_with_zero3_fits_on_94_gib_not_on_80():
    # ZeRO-3 in bf16 (DeepSpeed's bf16 mode): 1 + 2 (fp32 gradients) + 6 + 2 (the step's fp32 copy) bytes a parameter
    # and AdamW's temporaries for one sub-group of 1e9 parameters. The engines sleep through the trainer's step:
    # three phases, each must fit. On 80 GiB the update is over by the trainer's runtime buffers.
    assert "needs 80.9 GiB while the engines take the weight update" in refused(
        spec(COLOCATED_ZERO3, trainer={"zero_stage": 3}), TWO, SEVEN_B)
    plan = plan_placement(spec(COLOCATED_ZERO3, trainer={"zero_stage": 3}), TWO_94, SEVEN_B)
    assert [(g.phase, g.gpu, round(g.total_gib, 2)) for g in plan.memory.gpus] == [
        ("generating", 0, 70.77), ("generating", 1, 70.77), ("updating", 0, 80.93), ("updating", 1, 80.93),
        ("training", 0, 78.14), ("training", 1, 78.14)]
    generating, updating, training = (plan.memory.gpus[i] for i in (1, 3, 5))
    persistent = [("trainer rank 1", "CUDA context and runtime buffers (measured)", 2.7),
                  ("trainer rank 1", "weights", 6.52), ("trainer rank 1", "gradients", 13.04),
                  ("trainer rank 1", "fp32 master weights and Adam states", 39.12)]
    assert [(i.owner, i.what, round(i.gib, 2)) for i in generating.items] == persistent + [
        ("engine 0", "vLLM share (gpu_memory_utilization 0.1)", 9.4)]
    # the update: ZeRO-3 gathers the full weights; the engine's weights wake (split over its 2 GPUs), its KV cache not
    assert [(i.owner, i.what, round(i.gib, 2)) for i in updating.items] == persistent + [
        ("trainer rank 1", "largest module gathered for a weight sync (ZeRO-3)", 13.04),
        ("engine 0", "weights (awake for the update)", 6.52)]
    assert [(i.owner, i.what, round(i.gib, 2)) for i in training.items] == persistent + [
        ("trainer rank 1", "fp32 gradients and AdamW's temporaries at the optimizer step", 16.76)]
    text = plan.describe()
    assert "  GPU 0 of node 0, training: 78.1 of 94.0 GiB (trainer rank 0 CUDA context and runtime buffers " \
           "(measured) 2.7, weights 6.5, gradients 13.0, fp32 master weights and Adam states 39.1, fp32 gradients " \
           "and AdamW's temporaries at the optimizer step 16.8)" in text
    assert "colocated engines sleep while the trainer steps (vLLM sleep level 1: weights to host memory, KV cache " \
           "freed), and wake for the weight update and generation" in text
    assert "  an engine's share per GPU: 9.4 GiB, its weights 6.5, left for the KV cache and activations 2.9" in text


def test_colocated_engines_of_an_async_run_share_the_gpu_by_memory_and_never_sleep():
    # no phases: the engine generates in its share while the trainer steps beside it, so the step's
    # transient and the share add up on the one GPU
    plan = plan_placement(spec({"gpus": 1, "colocate": True}, mode="async", trainer={"zero_stage": 2}), ONE,
                          ModelSize(5 * 10**8))
    assert (plan.sleeps, plan.overlapped, plan.weight_backend) == (False, True, "gloo")
    (gpu,) = plan.memory.gpus
    assert (gpu.phase, round(gpu.total_gib, 2)) == ("", 54.41)
    assert [(i.owner, i.what, round(i.gib, 2)) for i in gpu.items] == [
        ("trainer rank 0", "CUDA context and runtime buffers (measured)", 2.3), ("trainer rank 0", "weights", 0.93),
        ("trainer rank 0", "gradients", 1.86), ("trainer rank 0", "fp32 master weights and Adam states", 5.59),
        ("trainer rank 0", "fp32 gradients and AdamW's temporaries at the optimizer step", 3.73),
        ("engine 0", "vLLM share (gpu_memory_utilization 0.5)", 40.0)]
    assert "colocated engines generate beside the trainer's steps in their memory share" in plan.describe()
    # 7B: the step beside the share does not fit, and the message says what would
    assert refused(spec({"gpus": 1, "colocate": True}, mode="async", trainer={"zero_stage": 2}), ONE) == (
        "resources: GPU 0 of node 0 needs 211.8 GiB, it has 80.0: trainer rank 0 CUDA context and runtime buffers "
        "(measured) 2.3, weights 13.0, gradients 26.1, fp32 master weights and Adam states 78.2, fp32 gradients and "
        "AdamW's temporaries at the optimizer step 52.2; engine 0 vLLM share (gpu_memory_utilization 0.5) 40.0. The "
        "largest is trainer rank 0's fp32 master weights and Adam states. To fit: raise trainer.zero_stage (now 2) "
        "or resources.trainer_ranks (now 1); lower resources.gpu_memory_utilization, or set resources.colocate false")


def test_a_kl_reference_tips_the_plan_over():
    # the first phase over: generation (the reference and the runtime buffers beside the engine's share)
    assert refused(spec(COLOCATED_ZERO3, trainer={"zero_stage": 3}, algorithm={"kl_coef": 0.1}), TWO) == (
        "resources: GPU 0 of node 0 needs 82.4 GiB while the engines generate, it has 80.0: trainer rank 0 CUDA "
        "context and runtime buffers (measured) 2.7, weights 6.5, gradients 13.0, fp32 master weights and Adam "
        "states 39.1, KL reference model 13.0; engine 0 vLLM share (gpu_memory_utilization 0.1) 8.0. The largest "
        "is trainer rank 0's fp32 master weights and Adam states. To fit: raise "
        "resources.trainer_ranks (now 2, ZeRO-3); set algorithm.kl_coef 0 (its reference model is a full copy on "
        "every trainer GPU); lower resources.gpu_memory_utilization, or set resources.colocate false")


def test_collective_receive_buffers_must_fit_beside_the_engines_share():
    # The receive holds two buckets at a time, each 32 MiB or the largest tensor: here a 151936 x 2048 bf16
    # embedding, 0.58 GiB, so 1.16 GiB (not the model: 5.6 GiB a copy)
    three_b = ModelSize(3 * 10**9, largest=151936 * 2048)  # trainer: 18 bytes a parameter (autocast), 50.3 GiB
    run = spec({"gpus": 2, "gpu_memory_utilization": 0.99}, mode="async", rollout={"weight_transport": "collective"})
    assert refused(run, TWO, three_b) == (
        "resources: GPU 1 of node 0 needs 80.4 GiB, it has 80.0: engine 0 vLLM share (gpu_memory_utilization 0.99) "
        "79.2, weight-receive buffers (collective transport, 2 buckets) 1.2. The largest is engine 0's vLLM "
        "share (gpu_memory_utilization 0.99). To fit: lower resources.gpu_memory_utilization; set "
        "rollout.weight_transport rpc (it receives the weights in host memory)")
    plan = plan_placement(spec({"gpus": 2}, mode="async"), TWO, three_b)  # rpc: received in host memory
    # + 1.4 GiB runtime buffers, and AdamW's temporaries (4 bytes a parameter) outgrow autocast's copies (2)
    assert [round(g.total_gib, 2) for g in plan.memory.gpus] == [57.28, 72.0]
    collective = spec({"gpus": 2, "gpu_memory_utilization": 0.98}, mode="async",
                      rollout={"weight_transport": "collective"})
    assert round(plan_placement(collective, TWO, three_b).memory.gpus[1].total_gib, 2) == 79.56
    # no tensor above a bucket: two buckets, 64 MiB
    assert round(plan_placement(collective, TWO, ModelSize(3 * 10**9)).memory.gpus[1].total_gib, 3) == 78.463


def test_an_engines_weights_must_leave_room_in_its_share():
    # checked before the GPUs' sums: vLLM itself would refuse ("No available memory for the cache blocks")
    assert refused(spec({"gpus": 2}, mode="async"), TWO, ModelSize(70 * 10**9)) == (
        "resources.gpu_memory_utilization: an engine's weights take 130.4 GiB per GPU, its share of a GPU is 72.0 "
        "GiB: nothing is left for the KV cache; raise resources.gpu_memory_utilization or resources.tensor_parallel")


def test_one_max_model_len_sequence_must_fit_the_kv_cache():
    llama_7b = ModelSize(7 * 10**9, kv_values_per_token=2 * 32 * 32 * 128)  # 512 KiB a token in bf16
    long = {"weight_transport": "rpc", "max_model_len": 131072}  # 64 GiB of KV cache on one GPU
    assert refused(spec({"gpus": 2}, mode="async", rollout=long, trainer={"zero_stage": 3}), TWO, llama_7b) == (
        "rollout.max_model_len: one sequence's KV cache takes 64.0 GiB per GPU, an engine's share leaves 59.0 GiB "
        "after its weights (activations come on top); lower rollout.max_model_len, or raise "
        "resources.gpu_memory_utilization or resources.tensor_parallel")
    plan = plan_placement(spec({"gpus": 4, "trainer_ranks": 2, "tensor_parallel": 2}, mode="async", rollout=long,
                               trainer={"zero_stage": 3}), FOUR, llama_7b)
    assert (round(plan.memory.kv_needed_gib, 2), round(plan.memory.kv_cache_gib, 2)) == (32.0, 65.48)


def test_a_colocated_plan_needs_the_model_size():
    assert refused(spec({"gpus": 1, "colocate": True}), ONE, None) == (
        "resources.colocate: the size of model.path 'm' is unknown (no model folder there), so the planner cannot "
        "check that the trainer's states and the engines' share fit a GPU together while the engines generate")
    plan = plan_placement(spec({"gpus": 2}, mode="async"), TWO)  # disaggregated: planned as before, unchecked
    assert plan.memory is None and "GPU memory not checked (model size unknown)" in plan.describe()


def test_trainer_bytes_per_parameter_by_dtype_and_stage():
    gib = 2**30  # parameters, so that bytes per parameter read as GiB

    def row(dtype, stage, ranks):
        m = trainer_memory(gib, dtype, stage, ranks)
        return (m.weights_gib, m.gradients_gib, m.optimizer_gib, m.step_gib, m.gather_gib, m.cast_gib, m.total_gib,
                m.reference_gib)

    # autocast: fp32 weights, gradients and moments, the forward's fp16 copies kept for the backward
    # autocast: fp32 weights, gradients and moments, the forward's fp16 copies kept for the backward (2) and
    # AdamW's temporaries at the step (4): the larger counts
    assert row("float16", 0, 1) == (4, 4, 8, 4, 0, 2, 20, 4)
    # stage 1/2 clone an fp32 master partition even from fp32; AdamW's temporaries for the partition, 4 / 4
    assert row("float32", 2, 4) == (4, 1, 3, 1, 0, 0, 9, 4)
    assert row("float32", 3, 4) == (1, 1, 2, 1, 4, 0, 8, 4)  # stage 3: the fp32 partition is its own master
    # bf16 mode: fp32 gradient partition, master + moments 12 / 4, the step's fp32 copy 4 / 4 and AdamW's 4 / 4
    assert row("bfloat16", 2, 4) == (2, 1, 3, 2, 0, 0, 8, 2)
    # stage 1: BF16_Optimizer keeps the bf16 .grad and a full fp32 gradient buffer; float16's ZeRO optimizer also
    # flattens its partition at the step
    assert row("bfloat16", 1, 4) == (2, 6, 3, 1, 0, 0, 12, 2)
    assert row("float16", 1, 4) == (2, 6, 3, 2, 0, 0, 13, 2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_precision_counted_is_the_trainers(dtype, stage):
    """workers/cluster/memory.py counts the precision workers/train/trainer.py configures."""
    from workers.cluster.trainer_memory import trainer_precision
    from workers.train.deepspeed_setup import deepspeed_config

    config = deepspeed_config(spec({}, trainer={"zero_stage": stage}, model={"path": "m", "dtype": dtype}))
    if "torch_autocast" in config:
        actual = "autocast"
    elif config.get("bf16", {}).get("enabled") or config.get("fp16", {}).get("enabled"):
        assert config["data_types"] == {"grad_accum_dtype": "fp32"}
        actual = "mixed"
    else:
        actual = "fp32"
    assert trainer_precision(dtype, stage) == actual


def _tiny_llama(folder, tied=False):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
        "tie_word_embeddings": tied}))
    return str(folder)


def test_model_size_counts_parameters_on_the_meta_device(tmp_path):
    # per layer: q 64x64 + k 64x32 + v 64x32 + o 64x64 + MLP 3x64x128 + 2 norms of 64 = 36992
    # (the largest tensor, and module: an MLP projection, 64 x 128, above the 100 x 64 embedding)
    assert model_size(_tiny_llama(tmp_path / "untied")) == ModelSize(2 * 36992 + 2 * 6400 + 64, 2 * 2 * 2 * 16,
                                                                     64 * 128, hidden=64, intermediate=128,
                                                                     layers=2, vocab=100, saved_dtype="float32",
                                                                     largest_module=64 * 128, heads=4, kv_hidden=32,
                                                                     family="gated", activation="silu")
    assert model_size(_tiny_llama(tmp_path / "tied", tied=True)).params == 2 * 36992 + 6400 + 64
    assert model_size(str(tmp_path / "none")) is None
    # the planner reads model.path itself (the controller has resolved it by then); CPU plans are not counted
    run = spec({"gpus": 1, "colocate": True}, path=_tiny_llama(tmp_path / "run"))
    assert [i.what for i in plan_placement(run, ONE).memory.gpus[0].items[:2]] == [
        "CUDA context and runtime buffers (measured)", "weights"]
    assert plan_placement(spec({}, mode="async", path=str(tmp_path / "run")), Machine(cpu_cores=2)).memory is None


def test_model_dtype_auto_is_planned_as_bfloat16_on_gpus_and_is_the_default():
    auto = validate_spec({"name": "t", "model": {"path": "m"}, "task": {"dataset": "gen:add"},
                          "schedule": {"mode": "sync"}, "resources": {"queue": "gpu", **COLOCATED_ZERO3},
                          "trainer": {"zero_stage": 3}})
    assert auto.model.dtype == "auto"
    planned = plan_placement(auto, TWO_94, SEVEN_B).memory
    bf16 = plan_placement(spec(COLOCATED_ZERO3, trainer={"zero_stage": 3}), TWO_94, SEVEN_B).memory
    assert [round(g.total_gib, 2) for g in planned.gpus] == [round(g.total_gib, 2) for g in bf16.gpus]


# Peaks measured on one H200 (docs/benchmarks.md, "On a GPU"; bench/results/gpu_h200.txt): bench/gpu_trainer.py on a
# 0.36 B-parameter model of Qwen2.5-0.5B's shape with a 2048-token vocabulary, one rank, bf16, kl_coef 0.05
# (the reference on the rank), micro_batch_tokens 256.
MEASURED_H200_PEAK_GIB = {0: 11.35, 2: 10.91, 3: 14.43}


@pytest.mark.parametrize("stage", sorted(MEASURED_H200_PEAK_GIB))
def test_the_planned_rank_peak_is_within_25_percent_of_the_peak_measured_on_a_gpu(stage, tmp_path):
    from workers.cluster.trainer_memory import trainer_rank_peak_gib

    folder = tmp_path / "qwen2-0.36b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 2048, "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "head_dim": 64, "tie_word_embeddings": True}))
    model = model_size(str(folder))
    assert round(model.params / 1e9, 2) == 0.36
    run = validate_spec({"name": "t", "model": {"path": "m", "dtype": "bfloat16"}, "task": {"dataset": "gen:add"},
                         "algorithm": {"kl_coef": 0.05, "minibatches": 1},
                         "trainer": {"zero_stage": stage, "micro_batch_tokens": 256}})
    planned, measured = trainer_rank_peak_gib(run, model, ranks=1), MEASURED_H200_PEAK_GIB[stage]
    assert abs(planned - measured) / measured <= 0.25, (planned, measured)  # it was 47-49% low at ZeRO 0 and 3
