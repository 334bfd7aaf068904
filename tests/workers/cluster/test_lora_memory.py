"""The memory planner with model.lora: gradients, the fp32 master copy and Adam's states are
counted for the adapter's parameters only, the frozen base model as weights alone, and the
KL reference as nothing (the base model with the adapter disabled) or, with model.lora.init,
as the frozen init adapter's weights."""
import pytest

from workers.cluster.memory import REFERENCE_STAGE, inference_items
from workers.cluster.model_size import ModelSize, model_size
from workers.cluster.trainer_memory import lora_trainer_memory, trainer_rank_peak_gib
from workers.spec import validate_spec

GIB = 2**30


def _spec(lora=None, **parts):
    model = {"path": "builtin:tiny", **({"lora": lora} if lora else {})}
    return validate_spec({"name": "m", "model": model, "task": {"dataset": "gen:add"}, **parts})


def test_the_adapter_is_counted_on_the_meta_model(tiny_model_path):
    lora = _spec({"rank": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}).model.lora
    size = model_size(tiny_model_path, lora)
    # 3 layers x 4 projections x rank 8 x (128 in + 128 out)
    assert (size.params, size.adapter) == (657408, 3 * 4 * 8 * (128 + 128)) == (657408, 24576)
    # target_modules left out: PEFT's default for qwen2 (q_proj, v_proj)
    assert model_size(tiny_model_path, _spec({"rank": 8}).model.lora).adapter == 3 * 2 * 8 * 256
    assert model_size(tiny_model_path).adapter is None


def test_lora_bytes_per_parameter_by_dtype_and_stage():
    # GiB-sized counts, so that bytes per parameter read as GiB: a base of 1 GiB parameters, an adapter of 1/64
    params, adapter = GIB, GIB // 64
    a = 1 / 64

    def row(dtype, stage, ranks):
        m = lora_trainer_memory(params, adapter, dtype, stage, ranks)
        return (m.weights_gib, m.gradients_gib, m.optimizer_gib, m.step_gib, m.gather_gib, m.cast_gib,
                m.reference_gib)

    # fp32: base 4 + adapter 4; gradients 4, Adam's moments 8 and AdamW's temporaries 4, of the adapter only
    assert row("float32", 0, 1) == (4 + 4 * a, 4 * a, 8 * a, 4 * a, 0, 0, 0)
    # autocast (bf16 at ZeRO 0): fp32 weights, and the forward's bf16 copies of all of them
    assert row("bfloat16", 0, 1) == (4 + 4 * a, 4 * a, 8 * a, 4 * a, 0, 2 + 2 * a, 0)
    # bf16 mode at ZeRO 2 over 4 ranks: the whole module in bf16, the adapter's fp32 gradient partition, master
    # and moments, and the step's fp32 copy and AdamW's temporaries, per rank
    assert row("bfloat16", 2, 4) == (2 + 2 * a, a, 3 * a, 2 * a, 0, 0, 0)


def test_a_lora_run_plans_far_less_than_full_fine_tuning_and_no_reference():
    model = ModelSize(params=GIB, adapter=GIB // 64)
    full = trainer_rank_peak_gib(_spec(algorithm={"kl_coef": 0.1}), model, 1, "float32")
    lora = trainer_rank_peak_gib(_spec({"rank": 8}, algorithm={"kl_coef": 0.1}), model, 1, "float32")
    # full: runtime 1.4 + weights 4 + gradients 4 + moments 8 + reference 4 + the step's temporaries 4
    assert full == pytest.approx(1.4 + 4 + 4 + 8 + 4 + 4)
    # LoRA: runtime 1.4 + the base's weights 4 and the adapter's 4/64 + its gradients 4/64, moments 8/64 and
    # temporaries 4/64; no reference
    assert lora == pytest.approx(1.4 + 4 + 20 / 64)


def test_a_run_from_an_adapter_counts_the_frozen_reference_adapter_where_the_reference_runs():
    from types import SimpleNamespace

    model = ModelSize(params=GIB, adapter=GIB // 64)
    lora = {"rank": 8, "init": "/srv/adapter"}
    fresh = trainer_rank_peak_gib(_spec({"rank": 8}, algorithm={"kl_coef": 0.1}), model, 1, "float32")
    init = trainer_rank_peak_gib(_spec(lora, algorithm={"kl_coef": 0.1}), model, 1, "float32")
    assert init == pytest.approx(fresh + 4 / 64)  # the reference adapter's fp32 weights, beside the base's
    assert trainer_rank_peak_gib(_spec(lora), model, 1, "float32") == pytest.approx(fresh)  # no KL: no copy
    staged = _spec(lora, algorithm={"kl_coef": 0.1, "kl_reference": "stage"})
    assert trainer_rank_peak_gib(staged, model, 1, "float32") == pytest.approx(fresh)
    worker = SimpleNamespace(name="KL reference stage", label=REFERENCE_STAGE)
    held = {i.what: i.gib for i in inference_items(staged, worker, model, None, "float32", False)}
    assert held["reference model"] == pytest.approx(4 + 4 / 64)  # the base model and the init adapter
