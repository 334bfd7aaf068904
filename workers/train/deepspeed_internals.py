"""What the trainer reaches into DeepSpeed (0.19) for: a ZeRO-3 module's full state dict,
gathered a module at a time, and where a streamed step's summed gradients are divided."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

def gathered_state_dict(module: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """A ZeRO-3 module's full state dict on the CPU, gathered one module's own parameters
    at a time and released before the next (a device holds one layer's full weights at
    once, not the model's: ZeRO-3 for a model larger than one GPU). A collective: every rank
    calls it, in the same order; ``keep`` False takes part and copies nothing.

    Gathered by parameter, not by module: every name a parameter has
    (``named_parameters(remove_duplicate=False)``: a tied parameter, or every parameter of a
    module shared under two names, which ``named_modules()`` would list once while
    ``state_dict()`` lists it under each) maps to it, each parameter is gathered once and its
    copy fills all its names. A name left ungathered would keep ZeRO-3's empty placeholder."""
    import deepspeed

    names: dict[int, list[str]] = {}
    groups: list[list[torch.nn.Parameter]] = []  # consecutive parameters of one owning module
    owner = None
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in names:
            names[id(p)].append(name)
            continue
        names[id(p)] = [name]
        prefix = name.rpartition(".")[0]
        if prefix != owner or not groups:
            groups.append([])
            owner = prefix
        groups[-1].append(p)
    out: dict[str, torch.Tensor] = {}
    for params in groups:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            if keep:
                for p in params:
                    copy = p.detach().to("cpu", copy=True)
                    for name in names[id(p)]:
                        out[name] = copy
    if not keep:
        return {}
    state = module.state_dict()  # names, order and buffers (never partitioned)
    return {k: out[k] if k in out else v.detach().to("cpu", copy=True) for k, v in state.items()}


# -- where a streamed step's summed gradients are divided (DeepSpeed 0.19 internals) ----------
# finish_step(rescale=True) divides gradients that were summed over the step by a denominator
# known only at its end. Where they are by then depends on the optimizer class DeepSpeed picked
# (engine.py _do_optimizer_sanity_check / _configure_optimizer for deepspeed_config's configs):
#   - ZeRO 0, any dtype (fp32 parameters; bf16/fp16 under autocast, fp16 with torch's
#     GradScaler): the torch optimizer itself, the gradients in ``p.grad``;
#   - ZeRO 1 bf16, ``BF16_Optimizer``: its own fp32 accumulation buffers
#     (``fp32_groups_gradients_flat``); ``p.grad`` holds only the last backward's bf16 gradient;
#   - ZeRO 1/2 (``DeepSpeedZeroOptimizer``) and 3 (``DeepSpeedZeroOptimizer_Stage3``), fp32, bf16
#     and fp16: partitions reduced by DeepSpeed's hooks, which ``step`` divides by its loss
#     scaler's ``cur_scale`` (``unscale_and_clip_grads``, the clip's norm and the reported grad
#     norm taken in the same scaled units).
# DeepSpeed has no "divide the gradients" call: ``deepspeed.utils.safe_set_full_grad`` writes
# ``p.grad`` where there is one (BF16_Optimizer keeps its fp32 sums beside it) and all-reduces
# each parameter; ``override_loss_scale`` turns the optimizer's dynamic fp16 loss scaling off for
# good (``custom_loss_scaler``: later losses scaled by the override, never by the scaler again).


def gradients_to_divide(engine) -> Optional[list[torch.Tensor]]:
    """The tensors holding ``engine``'s summed gradients, or None where its optimizer divides
    them itself (a ZeRO 1-3 optimizer with a loss scaler: ``loss_scale_times``)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = engine.optimizer
    if isinstance(optimizer, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)):
        return None
    if isinstance(optimizer, BF16_Optimizer):
        return list(optimizer.fp32_groups_gradients_flat)  # the views of each parameter's too
    return [p.grad for p in engine.module.parameters() if p.grad is not None]


@contextlib.contextmanager
def loss_scale_times(optimizer, factor: float):
    """A ZeRO 1-3 optimizer's loss scale multiplied by ``factor`` over one ``step``, which
    then divides the gradients by ``factor`` as well as by the scale the backward passes
    used: the whole-batch step's gradients, clip and grad norm. Afterwards its scaler holds
    what the whole-batch step leaves: the unmultiplied scale times the scaler's own change
    in the step (x2 after ``scale_window`` steps without overflow, /2 on an overflow past
    its hysteresis, x1 otherwise: powers of two, so exact), no lower than its ``min_scale``;
    its counters (iterations, last overflow, hysteresis) never saw the factor. The static
    scaler of fp32 and bf16 (scale 1) does not change in a step."""
    scaler = optimizer.loss_scaler
    before = scaler.cur_scale
    scaler.cur_scale = scaled = before * factor
    try:
        yield
    finally:
        lowered = scaler.cur_scale < scaled
        after = before * (scaler.cur_scale / scaled)
        if scaler.dynamic:
            after = max(after, scaler.min_scale)
        scaler.cur_scale = after
    if lowered and before == scaler.min_scale and getattr(scaler, "raise_error_at_min_scale", True):
        # what the whole-batch step's update_scale raises (loss_scaler.py), its scale at the floor
        raise Exception("Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")
