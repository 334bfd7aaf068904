"""A streamed step (stream training: losses summed as the batch arrives, the gradients
divided by the denominator in ``finish_step(rescale=True)``) is the whole-batch step in
bf16 and fp16 at every ZeRO stage, each precision on the optimizer
class DeepSpeed 0.19 picks for it:

- ZeRO 0, bf16/fp16: torch autocast over fp32 parameters (fp16 with torch's GradScaler);
- ZeRO 1, bf16: ``BF16_Optimizer`` (its fp32 gradients are its own buffer, not ``p.grad``);
- ZeRO 1/2, fp16 and ZeRO 2 bf16: ``DeepSpeedZeroOptimizer``; ZeRO 3: ``..._Stage3``
  (fp16 with DeepSpeed's dynamic loss scaler, whose state must be what a whole-batch
  step leaves: still dynamic, same scale, same overflow counters).

fp16 at ZeRO 1-3 runs on this CPU with DeepSpeed's accelerator told it has fp16 (torch's CPU
kernels compute it: tests/workers/train/test_precision.py), so the weights are compared at
every stage, and the loss scaler's state besides.

How the weights are compared. Adam's first step is about lr·sign(g): a gradient off by any
factor barely moves it (tests/workers/train/test_trainer_ranks.py's docstring). An AdamW eps
of 1, far above these gradients (|g| < 1e-2), makes the step lr·g/eps, linear in g, so a
gradient off by a factor shows in the weights by that factor. The fp32 master weights (what
AdamW updates; the bf16/fp16 copies round steps of ~6e-5 away) are compared through the
update's L2 norm: ||w_streamed - w_whole|| / ||w_whole - w_start||. Measured on this CPU:
fp32 4e-5, fp16 2e-3, bf16 7e-3 to 9e-3 (the backward's roundings differ between
a loss divided by d before it and a sum divided after, 2^-8 relative in bf16). The bugs
this catches left 22 (bf16 at ZeRO 1, BF16_Optimizer: its fp32 sums never divided by the
d = 24 tokens, ``p.grad`` was) and 30 (fp16 at ZeRO 1-3: ``override_loss_scale(d)`` divided
by d instead of d·2^16, and left the dynamic loss scaling off for good).
"""
import pytest
import torch

from workers.spec import validate_spec

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

# ||Δ streamed - Δ whole|| / ||Δ whole||: several times what each precision's roundings
# leave (above), a twentieth or less of what a gradient off by a factor of 2 would
TOLERANCE = {"bfloat16": 0.05, "float16": 0.02}


@pytest.fixture
def fp16_on_cpu(monkeypatch):
    """DeepSpeed's CPU accelerator says fp16 only where oneDNN has it; torch's CPU kernels
    still compute it, which is all these steps need (as in test_precision.py)."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)


def _spec(dtype: str, stage: int, path: str):
    return validate_spec({
        "name": "stream-precision", "model": {"path": path, "dtype": dtype}, "task": {"dataset": "gen:add"},
        "algorithm": {"lr": 1e-2, "warmup_steps": 0, "minibatches": 1},
        "trainer": {"zero_stage": stage, "micro_batch_tokens": 32},  # several micro-batches per part
    })


def _batch(scale: float = 1.0):
    from workers.models.tinymodel import encode
    from workers.train.samples import TrainSample

    return [TrainSample(encode(f"{i}+{i}="), [3, 4, 5, 6], [-1.0] * 4, scale * (i % 2 * 2 - 1) * (1 + i))
            for i in range(6)]


def _trainer(dtype: str, stage: int, path: str):
    from workers.train.trainer import Trainer

    trainer = Trainer(_spec(dtype, stage, path), path, threads=1)
    for group in trainer.engine.basic_optimizer.param_groups:  # the AdamW under DeepSpeed's wrapper
        group["eps"] = 1.0  # the step linear in the gradient (module docstring)
    return trainer


def _streamed_step(trainer, batch) -> None:
    trainer.begin_step()
    trainer.accumulate(batch[:3])
    trainer.accumulate(batch[3:])
    trainer.finish_step(len(batch), rescale=True)


def _master(trainer) -> dict[str, torch.Tensor]:
    """The fp32 weights AdamW updates: the parameters under autocast (ZeRO 0), else
    DeepSpeed's fp32 master copy (gathered at ZeRO 3)."""
    from deepspeed.utils import safe_get_full_fp32_param

    params = trainer.engine.module.named_parameters()
    if trainer.spec.trainer.zero_stage == 0:
        return {n: p.detach().float().clone() for n, p in params}
    return {n: safe_get_full_fp32_param(p).detach().float().clone() for n, p in params}


def _norm(a: dict, b: dict) -> float:
    return sum(float(((a[k] - b[k]) ** 2).sum()) for k in a) ** 0.5


def _scaler_state(trainer) -> dict:
    """The fp16 loss scaler's state: torch's GradScaler at ZeRO 0, DeepSpeed's dynamic loss
    scaler at ZeRO 1-3 (and whether the optimizer still uses it, not a fixed scale)."""
    engine = trainer.engine
    if engine.torch_autocast_z0_gradscaler is not None:
        return {"skipped": engine.skipped_steps, **engine.torch_autocast_z0_gradscaler.state_dict()}
    optimizer, scaler = engine.optimizer, engine.optimizer.loss_scaler
    return {"skipped": engine.skipped_steps, "custom_loss_scaler": optimizer.custom_loss_scaler,
            "loss_scale": optimizer.loss_scale, "dynamic": scaler.dynamic, "cur_scale": scaler.cur_scale,
            "cur_iter": scaler.cur_iter, "last_overflow_iter": scaler.last_overflow_iter,
            "cur_hysteresis": scaler.cur_hysteresis}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_streamed_step_is_the_whole_batch_step(dtype, stage, tiny_model_path, fp16_on_cpu):
    batch = _batch()
    whole = _trainer(dtype, stage, tiny_model_path)
    start = _master(whole)
    whole.train_step(batch)
    streamed = _trainer(dtype, stage, tiny_model_path)
    assert _norm(_master(streamed), start) == 0.0
    _streamed_step(streamed, batch)
    want, got = _master(whole), _master(streamed)
    step = _norm(want, start)
    assert step > 0
    assert _norm(got, want) / step < TOLERANCE[dtype], type(whole.engine.optimizer).__name__
    if dtype == "float16":
        assert _scaler_state(streamed) == _scaler_state(whole)
        assert _scaler_state(streamed)["skipped"] == 0
    # and the next step, a whole batch on both, still agrees (the loss scale was put back)
    whole.train_step(batch)
    streamed.train_step(batch)
    assert _norm(_master(streamed), _master(whole)) / step < TOLERANCE[dtype]
    if dtype == "float16":
        assert _scaler_state(streamed) == _scaler_state(whole)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_fp16_overflow_in_a_streamed_step_is_skipped_and_moves_the_scaler_as_a_whole_batch_step(
        stage, tiny_model_path, fp16_on_cpu):
    """Advantages of 1e5 overflow fp16's backward at the loss scale of 2^16: DeepSpeed skips
    the step and, with hysteresis 2, halves the scale at the second overflow (torch's
    GradScaler at the first). The streamed steps skip and move the scaler the same, and
    the ordinary step after them is the whole batch's."""
    whole = _trainer("float16", stage, tiny_model_path)
    streamed = _trainer("float16", stage, tiny_model_path)
    start = _master(whole)
    states = []
    for n, scale in enumerate((1e5, 1e5, 1.0)):
        batch = _batch(scale)
        whole.train_step(batch)
        _streamed_step(streamed, batch)
        state = _scaler_state(whole)
        assert _scaler_state(streamed) == state, n
        states.append(state)
        if n < 2:  # skipped: the weights did not move (the engine counts skips at ZeRO 1-3)
            assert _norm(_master(whole), start) == 0.0 and _norm(_master(streamed), start) == 0.0
            assert stage == 0 or state["skipped"] == n + 1
    assert stage == 0 or states[2]["skipped"] == 2
    scale_key = "scale" if stage == 0 else "cur_scale"
    assert states[2][scale_key] < 2.0 ** 16  # the overflows lowered it
    want = _master(whole)
    assert _norm(_master(streamed), want) / _norm(want, start) < TOLERANCE["float16"]


def test_an_fp16_overflow_at_the_minimum_loss_scale_stops_a_streamed_step_as_a_whole_batch_one(
        tiny_model_path, fp16_on_cpu):
    """DeepSpeed's scaler refuses to go below its min_scale (raise_error_at_min_scale): the
    streamed step, whose scale is multiplied by the denominator for the step, refuses too."""
    trainers = [_trainer("float16", 1, tiny_model_path) for _ in range(2)]
    for trainer in trainers:
        scaler = trainer.engine.optimizer.loss_scaler
        scaler.cur_scale, scaler.cur_hysteresis = scaler.min_scale, 1
    whole, streamed = trainers
    with pytest.raises(Exception, match="already at minimum"):
        whole.train_step(_batch(1e9))
    with pytest.raises(Exception, match="already at minimum"):
        _streamed_step(streamed, _batch(1e9))
    assert streamed.engine.optimizer.loss_scaler.cur_scale == streamed.engine.optimizer.loss_scaler.min_scale
