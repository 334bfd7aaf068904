"""The critic of PPO-RLHF (algorithm.advantage: gae): a value model, trained by a DeepSpeed
engine of its own beside the policy's, in the trainer's process.

The value model is the policy's model folder loaded as a bare transformer (``AutoModel``:
the LM head left out) with a scalar head, initialised to 0, on its last hidden states. Its
value at position t estimates the return of the completion before token t+1 is emitted,
so values line up with the trainer's per-token layout (position t predicts token t+1).

What it does per batch (workers/train/trainer.py drives it):
1. ``values``: a no-grad forward over the batch, the values the advantages are computed
   from (GAE, workers/train/algorithms.py) and the old values of the clipped value loss;
2. ``accumulate``: forward and backward of the clipped value loss per micro-batch, beside
   the policy's, with the same denominator and accumulation boundaries;
3. ``step``: its optimiser step, at the policy's.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from workers.spec import RunSpec
from workers.tasks.model_folder import check_model_folder
from workers.train import algorithms

CHECKPOINT_TAG = "critic"  # the critic's DeepSpeed files sit beside the policy's ("ds") in a checkpoint


class ValueModel(torch.nn.Module):
    """A transformer trunk with a scalar value head on every position."""

    def __init__(self, trunk: torch.nn.Module):
        super().__init__()
        self.trunk = trunk
        self.value_head = torch.nn.Linear(trunk.config.hidden_size, 1)
        # 0 at the start: the first advantages are the plain returns, not a random head's noise
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()


class Critic:
    def __init__(self, spec: RunSpec, model_path: str, config: dict, load_dtype: torch.dtype,
                 autocast_dtype: Optional[torch.dtype], device_type: str):
        """``config``: the DeepSpeed config (workers/train/deepspeed_setup.py deepspeed_config at the
        critic's ZeRO stage); ``load_dtype`` / ``autocast_dtype`` as the policy's."""
        import deepspeed
        from transformers import AutoModel

        self.spec = spec
        self.autocast_dtype = autocast_dtype
        self.device_type = device_type
        from workers.train.deepspeed_setup import partitioned_loading

        with partitioned_loading(config):  # the value head, built after, is partitioned by deepspeed.initialize
            trunk = AutoModel.from_pretrained(check_model_folder(model_path), dtype=load_dtype)
        model = ValueModel(trunk)
        lr = spec.critic.lr or spec.algorithm.lr
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=spec.algorithm.weight_decay)
        # the caller (Trainer) has reset DeepSpeed's autocast globals for this engine
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        self.engine.module.eval()  # no dropout: the values of step 1 and 2 must be one function's

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def values(self, ids: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """[batch, seq-1] values in the trainer's layout (no gradient)."""
        with torch.no_grad(), self._autocast():
            return self.engine.module(ids, att)[:, :-1].float()

    def accumulate(self, ids: torch.Tensor, att: torch.Tensor, mask: torch.Tensor, old_values: torch.Tensor,
                   returns: torch.Tensor, denominator: float, boundary: bool,
                   grad_scale: float = 1.0) -> tuple[float, float]:
        """One micro-batch's clipped value loss, backpropagated; returns (loss, clip share).
        ``grad_scale``: the data-parallel world size, as for the policy (DeepSpeed averages
        gradients over ranks where the step's loss is their sum)."""
        self.engine.set_gradient_accumulation_boundary(boundary)
        values = self.engine(ids, att)[:, :-1].float()
        loss, clip_frac = algorithms.value_loss(values, old_values, returns, mask, self.spec.critic.value_clip,
                                                denominator)
        self.engine.backward(loss * grad_scale if grad_scale != 1.0 else loss)
        return float(loss.detach()), clip_frac

    def idle_pass(self, ids: torch.Tensor, att: torch.Tensor, boundary: bool) -> None:
        """A forward and backward that change nothing (output × 0), for a rank with fewer
        micro-batches than its peers: ZeRO-2/3 reduce gradients in every backward, so every
        rank must run the same number."""
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(self.engine(ids, att).sum() * 0.0)

    def step(self) -> None:
        self.engine.step()

    def save_state(self, folder: str) -> None:
        self.engine.save_checkpoint(folder, tag=CHECKPOINT_TAG, save_latest=False)

    def load_state(self, folder: str) -> None:
        path, _ = self.engine.load_checkpoint(folder, tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"no critic checkpoint in {folder}")
