"""A streamed step's gradients: algorithm.whiten_advantages applied to gradients summed before
the batch's mean and std were known, and the division by the step's denominator, for every
optimizer class DeepSpeed uses. A mixin of ``Trainer`` (workers/train/trainer.py), whose
engine, critic and step accumulators it reads."""
from __future__ import annotations

import contextlib

import torch

from workers.train import algorithms
from workers.train.deepspeed_internals import gradients_to_divide, loss_scale_times
from workers.train.samples import whitening_moments


class StreamedGradients:
    # -- algorithm.whiten_advantages in a streamed GAE step ---------------------------------------
    # The whole-batch step whitens the advantages over the batch, Â = (A − μ) / (σ + eps), and
    # μ, σ of a streamed batch are known only at its end. The policy loss is linear in the
    # advantages there: one optimiser step, so π_prox = π_θ and the ratio is exactly 1, inside
    # the clip (PPO's clip branch has the same gradient then; reinforce is linear outright). So
    # with g(X) the gradient of the loss at advantages X,
    #     g(Â) = (g(A − c) − (μ − c)·g(1)) / (σ + eps),
    # c any constant: the first part's mean advantage (on this rank), which keeps the difference
    # small where the batch's advantages are nearly alike (σ ≈ 0: a raw g(A) − μ·g(1) would leave
    # float noise divided by eps). The engine accumulates g(A − c) in ``p.grad``; g(1), and the
    # KL penalty's gradient (not scaled by the whitening), accumulate apart, in fp32 tensors
    # shaped like the trainable parameters: each one more engine backward of the micro-batch's
    # graph (DeepSpeed refuses any backward through its forward but its own), its gradients
    # moved out of ``p.grad``. finish_step adds them into ``p.grad`` and divides the policy's by
    # σ + eps with the denominator. The cost: one or two extra backward passes per micro-batch
    # and one or two fp32 copies of the trainable parameters. Only ZeRO-0 keeps the gradients in
    # ``p.grad`` (ZeRO 1-3 move them into their own buffers and partitions as they are made),
    # and fp16 scales them: the spec refuses those for it.
    def _trainable(self) -> list[torch.Tensor]:
        return [p for p in self.engine.module.parameters() if p.requires_grad]

    def _side_gradient(self, key: str, loss: torch.Tensor) -> None:
        """``loss``'s gradient added to the side sum ``key`` and kept out of the engine's (whose
        sum ``p.grad`` is put back); the graph is kept for the micro-batch's own backward."""
        params = self._trainable()
        stash = [p.grad for p in params]
        boundary = self.engine.is_gradient_accumulation_boundary()
        for p in params:
            p.grad = None
        self.engine.set_gradient_accumulation_boundary(False)  # no all-reduce of a side gradient
        try:
            self.engine.backward(loss, retain_graph=True)
            sums = self._side.get(key)
            if sums is None:
                sums = self._side[key] = [torch.zeros_like(p, dtype=torch.float32) for p in params]
            with torch.no_grad():
                for total, p in zip(sums, params):
                    if p.grad is not None:
                        total.add_(p.grad.float())
        finally:
            for p, g in zip(params, stash):
                p.grad = g
            self.engine.set_gradient_accumulation_boundary(boundary)

    def _whiten_streamed_gradients(self) -> float:
        """Whiten a streamed step's accumulated policy gradients (``p.grad``, summed) with the
        whole step's mean and std (over all ranks: a collective every rank calls); returns
        σ + eps, by which they still need dividing."""
        mean, std = whitening_moments(self.critic_sums, self._all_reduce_sum)
        scale = std + algorithms.WHITEN_EPS
        offset = mean - (self._shift or 0.0)
        ones, kl = self._side.get("ones"), self._side.get("kl")
        with torch.no_grad():
            for i, p in enumerate(self._trainable()):
                if ones is None and kl is None:
                    break
                fix = torch.zeros_like(p, dtype=torch.float32)
                if ones is not None:
                    fix.add_(ones[i], alpha=-offset)
                if kl is not None:
                    fix.add_(kl[i], alpha=scale)
                if p.grad is None:
                    p.grad = fix.to(p.dtype)
                else:
                    p.grad.add_(fix.to(p.grad.dtype))
        self._side = {}
        acc = self._acc
        acc["loss"] = (acc["loss"] - offset * acc["loss_ones"]) / scale
        return scale

    def _divide_streamed_gradients(self, denominator: float, steps: contextlib.ExitStack,
                                   policy_scale: float = 1.0) -> None:
        """A streamed step's gradients (sums until now) divided by its denominator, for every
        optimizer class DeepSpeed uses (see ``gradients_to_divide``), the policy's (by
        ``denominator`` times ``policy_scale``) and the critic's; ``steps`` holds, until both
        have stepped, what their optimizers divide in it.

        - ZeRO-0 (``p.grad``) and ZeRO-1 bf16 (BF16_Optimizer's fp32 sums): divided where they
          are, then reduced over the data-parallel ranks.
        - ZeRO-1/2/3 otherwise: DeepSpeed's hooks move gradients into partitions as they are
          made, and its end-of-accumulation reduction runs in the backward that is marked the
          boundary, which none of the streamed ones was (the last was not known to be last).
          So one backward of zero loss (``_idle_pass``) is marked the boundary, then the
          optimizer's loss scale is multiplied by the denominator for its ``step``, which
          divides the gradients by it before clipping, as it unscales fp16 losses
          (``loss_scale_times``: the dynamic fp16 scaler is left as a whole-batch step leaves it)."""
        parts = [(self.engine, lambda: self.engine.backward(self._idle_pass(self.engine)), denominator * policy_scale)]
        if self.critic is not None:
            parts.append((self.critic.engine, lambda: self.critic.idle_pass(*self._idle_ids(), boundary=True),
                          denominator))
        for engine, idle_pass, divisor in parts:
            engine.set_gradient_accumulation_boundary(True)
            gradients = gradients_to_divide(engine)
            if gradients is None:  # a ZeRO optimizer that unscales in its step
                idle_pass()
                steps.enter_context(loss_scale_times(engine.optimizer, float(divisor)))
                continue
            with torch.no_grad():
                for grad in gradients:
                    grad.div_(divisor)
            if torch.distributed.get_world_size() > 1:
                engine.allreduce_gradients()
