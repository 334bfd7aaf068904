"""Precision that is right or refused: the DeepSpeed config each
model.dtype x ZeRO stage trains under (read back through DeepSpeed's own config parser),
the refusal of fp16 where the accelerator has none, and real steps on the CPU under bf16
(and fp16, with DeepSpeed's CPU accelerator told it has fp16: torch's CPU kernels run it)
that check the config reached the engine."""
import json
import math
import os

import pytest
import torch

from workers.spec import validate_spec
from workers.train.deepspeed_setup import FP16_LOSS_SCALING, PrecisionError, deepspeed_config


def _spec(dtype: str, stage: int = 0, path: str = "m", **algorithm):
    return validate_spec({
        "name": "precision", "model": {"path": path, "dtype": dtype}, "task": {"dataset": "gen:add"},
        "algorithm": {"lr": 1e-3, "warmup_steps": 0, **algorithm},
        "trainer": {"zero_stage": stage, "micro_batch_tokens": 32},
    })


def _parsed(config: dict):
    """DeepSpeed's own reading of the config (its sections forbid unknown keys)."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(config)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_float32_has_no_mixed_precision(stage):
    config = deepspeed_config(_spec("float32", stage))
    assert not {"bf16", "fp16", "torch_autocast", "data_types"} & set(config)
    assert config["zero_optimization"] == {"stage": stage}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_zero_0_trains_fp32_weights_under_autocast(dtype):
    # DeepSpeed 0.19.8 raises NotImplementedError for bf16/fp16 params with fp32 gradient
    # accumulation without ZeRO; its bf16 mode alone would sum micro-batches in bf16.
    config = deepspeed_config(_spec(dtype, 0), fp16_supported=False, device="cpu")
    assert config["torch_autocast"] == {"enabled": True, "dtype": dtype}
    assert not {"bf16", "fp16", "data_types"} & set(config)
    parsed = _parsed(config)
    assert parsed.torch_autocast_enabled and parsed.torch_autocast_dtype == getattr(torch, dtype)
    assert not parsed.bfloat16_config.enabled and not parsed.float16_config.enabled


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_at_zero_1_to_3_accumulates_gradients_in_fp32(stage):
    config = deepspeed_config(_spec("bfloat16", stage), fp16_supported=False, device="cpu")
    assert config["bf16"] == {"enabled": True}
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "fp16" not in config and "torch_autocast" not in config
    parsed = _parsed(config)
    assert parsed.bfloat16_config.enabled and parsed.grad_accum_dtype == "fp32"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_at_zero_1_to_3_uses_dynamic_loss_scaling_on_a_gpu(stage):
    config = deepspeed_config(_spec("float16", stage), fp16_supported=True, device="cuda")
    assert config["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                              "hysteresis": 2, "min_loss_scale": 1}
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}
    parsed = _parsed(config)
    fp16 = parsed.float16_config
    assert fp16.enabled and fp16.loss_scale == 0  # 0 = dynamic
    assert fp16.initial_dynamic_scale() == 2 ** FP16_LOSS_SCALING["initial_scale_power"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_where_the_accelerator_has_none_is_refused_with_what_to_use(stage):
    with pytest.raises(PrecisionError) as err:
        deepspeed_config(_spec("float16", stage), fp16_supported=False, device="cpu")
    message = str(err.value)
    assert f"model.dtype float16 with trainer.zero_stage {stage}" in message
    assert "cpu accelerator has no fp16" in message
    assert "bfloat16" in message and "trainer.zero_stage 0" in message


def test_the_rest_of_the_config_is_unchanged():
    config = deepspeed_config(_spec("bfloat16", 2, grad_clip=0.5))
    assert config["train_micro_batch_size_per_gpu"] == 1 and config["gradient_accumulation_steps"] == 1
    assert config["gradient_clipping"] == 0.5


# -- real steps on the CPU --------------------------------------------------------------------

def _batch():
    from workers.models.tinymodel import encode
    from workers.train.samples import TrainSample

    # micro_batch_tokens 32: the batch packs into several micro-batches, so gradients accumulate
    return [TrainSample(encode(f"{i}+{i}="), [3, 4, 5, 6], [-1.0] * 4, float(i % 2 * 2 - 1)) for i in range(6)]


@pytest.fixture
def fp16_on_cpu(monkeypatch):
    """DeepSpeed's CPU accelerator says fp16 only where oneDNN has it (not on this machine);
    torch's CPU kernels still compute it, which is all these steps need."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)


@pytest.mark.engine
@pytest.mark.timeout(300)
def test_a_bf16_step_at_zero_0_runs_under_autocast_with_fp32_weights(tiny_model_path, tmp_path):
    from workers.train.trainer import Trainer

    trainer = Trainer(_spec("bfloat16", 0, tiny_model_path, kl_coef=0.05, minibatches=1), tiny_model_path, threads=1)
    engine = trainer.engine
    assert engine.torch_autocast_enabled() and engine.torch_autocast_dtype() == torch.bfloat16
    assert not engine.bfloat16_enabled()
    assert engine.get_data_types() == (torch.float32, torch.float32)  # weights, gradients, AdamW
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())
    first = trainer.train_step(_batch())
    second = trainer.train_step(_batch())
    assert first["loss/kl"] == 0.0  # the reference computes exactly as the policy did
    assert all(math.isfinite(v) for v in (*first.values(), *second.values()))
    assert second["loss/kl"] > 0
    assert first["trainer/micro_batches"] > 1
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in engine.module.parameters())
    state = trainer.state_dict()  # what the engines load: model.dtype
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.bfloat16}
    trainer.save(str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.engine
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_bf16_step_at_zero_1_to_3_accumulates_in_fp32(stage, tiny_model_path, tmp_path):
    from workers.io.checkpoint import missing_trainer_shards
    from workers.train.trainer import Trainer

    trainer = Trainer(_spec("bfloat16", stage, tiny_model_path), tiny_model_path, threads=1)
    engine = trainer.engine
    assert engine.bfloat16_enabled() and not engine.torch_autocast_enabled()
    assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    optimizer = type(engine.optimizer).__name__
    if stage == 1:
        assert optimizer == "BF16_Optimizer"  # engine.py _do_optimizer_sanity_check: bf16 + fp32 accumulation
    else:
        assert engine.optimizer.gradient_accumulation_dtype == torch.float32, optimizer
    stats = trainer.train_step(_batch())
    assert stats["trainer/micro_batches"] > 1
    assert all(math.isfinite(v) for v in stats.values())
    # the checkpoint's file names are still DeepSpeed's bf16 ones (workers/io/checkpoint.py)
    trainer.save_state(str(tmp_path / "trainer"))
    assert missing_trainer_shards(tmp_path / "trainer", 1, stage, bf16=True) == []
    assert trainer.load_state(str(tmp_path / "trainer")) == 1


@pytest.mark.engine
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 3])
def test_an_fp16_step_at_zero_1_to_3_is_loss_scaled(stage, tiny_model_path, fp16_on_cpu):
    from workers.train.trainer import Trainer

    trainer = Trainer(_spec("float16", stage, tiny_model_path), tiny_model_path, threads=1)
    engine = trainer.engine
    assert engine.fp16_enabled() and engine.dynamic_loss_scale()
    assert engine.get_data_types() == (torch.float16, torch.float32)
    assert engine.optimizer.gradient_accumulation_dtype == torch.float32
    before = {k: v.clone() for k, v in trainer.state_dict().items()}  # on the CPU: the module's own tensors
    stats = trainer.train_step(_batch())
    assert all(math.isfinite(v) for v in stats.values())
    assert engine.skipped_steps == 0  # no overflow at 2^16: the step was taken
    after = trainer.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.engine
@pytest.mark.timeout(300)
def test_an_fp16_step_at_zero_0_has_deepspeeds_grad_scaler(tiny_model_path):
    from workers.train.trainer import Trainer

    trainer = Trainer(_spec("float16", 0, tiny_model_path), tiny_model_path, threads=1)
    assert trainer.engine.torch_autocast_z0_gradscaler is not None  # engine.py: Z0 + fp16 autocast
    stats = trainer.train_step(_batch())
    assert all(math.isfinite(v) for v in stats.values())
    assert {v.dtype for v in trainer.state_dict().values() if v.is_floating_point()} == {torch.float16}
    # DeepSpeed keeps autocast in module globals; a later fp32 engine in this process must not
    # inherit it (its ZeRO optimizer would take the fp16 paths: a different step, measured).
    from deepspeed.runtime.torch_autocast import is_autocast_initialized

    assert is_autocast_initialized()
    Trainer(_spec("float32", 1, tiny_model_path), tiny_model_path, threads=1)
    assert not is_autocast_initialized()


@pytest.mark.engine
@pytest.mark.timeout(300)
def test_fp16_at_zero_1_on_this_cpu_is_refused_before_deepspeed_starts(tiny_model_path):
    from deepspeed.accelerator import get_accelerator

    from workers.train.trainer import Trainer

    if get_accelerator().is_fp16_supported():
        pytest.skip("this machine's accelerator has fp16")
    with pytest.raises(PrecisionError, match="has no fp16 here"):
        Trainer(_spec("float16", 1, tiny_model_path), tiny_model_path, threads=1)
