"""Trainer: a DeepSpeed engine over the policy (gloo on CPU, NCCL on GPU), the RL
losses, token-budget packing and the weights handed to the rollout engines.

``train_step`` trains one batch: by default one optimiser step, the batch packed into
micro-batches (first-fit-decreasing by padded tokens) whose gradients accumulate, the
loss denominator fixed for the whole step so packing does not change the objective.
With ``algorithm.minibatches`` / ``ppo_epochs``, the batch is split into several
optimiser steps, with the proximal policy of decoupled PPO fixed at the start of the
batch (AReaL): only then does π_θ drift from π_prox, and the clip bind.

The no-grad forwards (π_prox, the reference, the critic's values, idle passes) are in
trainer_forwards.py, the weights that leave the trainer in trainer_weights.py, a streamed
step's gradient arithmetic in streamed_gradients.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from typing import Optional

import torch

from workers.train import algorithms
from workers.train.deepspeed_setup import (AUTOCAST_DTYPES, deepspeed_config, forget_earlier_autocast, init_distributed,
                                          limit_heap_fragmentation, partitioned_loading)
from workers.spec import RunSpec, model_dtype
from workers.tasks.model_folder import check_model_folder
from workers.train.samples import TrainSample, minibatch_parts, needs_proximal, step_denominator
from workers.train.streamed_gradients import StreamedGradients
from workers.train.trainer_forwards import TrainerForwards
from workers.train.trainer_weights import TrainerWeights


class Trainer(TrainerForwards, TrainerWeights, StreamedGradients):
    def __init__(self, spec: RunSpec, model_path: str, threads: Optional[int] = None, pad_id: int = 0):
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        import deepspeed
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        limit_heap_fragmentation()
        self.spec = spec
        self.model_path = model_path
        self.pad_id = pad_id  # any id: padded positions are masked out of attention and loss
        algo = spec.algorithm
        init_distributed()
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        config = deepspeed_config(spec, fp16_supported=bool(accelerator.is_fp16_supported()),
                                  device=accelerator.device_name())
        # ZeRO 0 with bfloat16/float16: the autocast dtype (fp32 parameters, low-precision
        # matmuls); the weights that leave the trainer are cast to it. None otherwise.
        self.autocast_dtype = AUTOCAST_DTYPES.get(config.get("torch_autocast", {}).get("dtype"))
        self.device_type = accelerator.device_name()
        torch.manual_seed(spec.seed)
        # Under autocast the policy's parameters are fp32 (they are what AdamW updates). In
        # DeepSpeed's bf16/fp16 modes the engine casts the parameters itself and makes its fp32
        # master copy from the cast ones (engine.py _configure_distributed_model), so loading
        # them in fp32 first would buy nothing but twice the host memory: the spec's dtype.
        load = torch.float32 if self.autocast_dtype is not None else getattr(torch, model_dtype(spec))
        with partitioned_loading(config if spec.model.lora is None else {}):  # ZeRO-3 is refused with model.lora
            model = AutoModelForCausalLM.from_pretrained(check_model_folder(model_path), dtype=load)
        if spec.trainer.gradient_checkpointing:  # the planner counts activations accordingly (cluster/memory.py)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.lora = spec.model.lora
        if self.lora is not None:  # only the adapter trains (workers/train/lora.py)
            from workers.train import lora

            if spec.trainer.gradient_checkpointing:  # the frozen embedding's output must carry gradients
                model.enable_input_require_grads()
            model = lora.wrap(model, self.lora)
            if self.lora.init:  # a run that starts from an adapter (before DeepSpeed copies the weights)
                lora.load_initial_adapter(model, self.lora)
                if algo.kl_coef > 0 and algo.kl_reference == "trainer":  # the starting policy is the reference
                    lora.keep_reference_adapter(model)
        self._load_reference(model_path, load)
        # over the parameters that train: with model.lora the adapter's alone (no state for the frozen base)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=algo.lr, weight_decay=algo.weight_decay)
        total = spec.stop.max_steps * algo.minibatches * algo.ppo_epochs  # optimiser steps in the whole run
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: algorithms.lr_factor(
            s, algo.warmup_steps, algo.lr_decay, total, algo.lr_floor))
        forget_earlier_autocast()
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                    lr_scheduler=scheduler)
        if self.reference is not None:
            # The reference's log-probs meet the policy's input ids, on the engine's device
            # (cuda:LOCAL_RANK on a GPU; DeepSpeed moved only the policy there).
            self.reference.to(self.engine.device)
        self._load_critic(model_path, accelerator, load)
        self.critic_sums: Optional[dict[str, float]] = None
        self.version = 0
        self.temperature = max(spec.rollout.temperature, 1e-5)

    # -- training ----------------------------------------------------------------
    def train_step(self, batch: list[TrainSample]) -> dict[str, float]:
        """Train on a whole batch: one optimiser step, or ``minibatches`` × ``ppo_epochs``
        of them; the policy version advances once either way."""
        algo = self.spec.algorithm
        critic_stats: dict[str, float] = {}
        if self.critic is not None:
            batch, sums = self.critic_targets(batch)
            critic_stats = algorithms.critic_stats(sums)
        if algo.minibatches == 1 and algo.ppo_epochs == 1:
            self.begin_step()
            self.accumulate(batch, denominator=self._denominator(batch), last=True)
            return {**self.finish_step(len(batch)), **critic_stats}
        t0 = time.perf_counter()
        parts = minibatch_parts(len(batch), algo.minibatches, algo.ppo_epochs, self.spec.seed, self.version)
        need = [i for i, needed in enumerate(needs_proximal(parts, len(batch))) if needed]
        batch = list(batch)
        for i, p in zip(need, self.proximal_logprobs([batch[i] for i in need])):
            batch[i] = dataclasses.replace(batch[i], prox_logprobs=p)
        steps = []
        for part in parts:
            minibatch = [batch[i] for i in part]
            self.begin_step()
            self.accumulate(minibatch, denominator=self._denominator(minibatch), last=True)
            steps.append(self._optimizer_step())
        self.version += 1
        tokens = sum(st["tokens"] for st in steps) or 1
        if self.critic is not None:
            critic_stats["critic/value_loss"] = sum(st["value_loss"] for st in steps) / len(steps)
            critic_stats["critic/value_clip_frac"] = sum(st["value_clip"] for st in steps) / tokens
        return {
            **critic_stats,
            "loss/policy": sum(st["loss"] for st in steps) / len(steps),
            "loss/kl": sum(st["kl"] for st in steps) / len(steps),
            "policy/clip_frac": sum(st["clip"] for st in steps) / tokens,
            "policy/behav_dropped_frac": sum(st["dropped"] for st in steps) / tokens,
            "policy/entropy": sum(st["entropy"] for st in steps) / tokens,
            **algorithms.mismatch_stats(functools.reduce(algorithms.MismatchSums.add, (st["mismatch"] for st in steps)),
                                        tokens, sum(st["dropped"] for st in steps),
                                        sum(st["truncated"] for st in steps)),
            "trainer/tokens_per_s": sum(st["padded"] for st in steps) / (time.perf_counter() - t0),
            "trainer/micro_batches": sum(st["micro"] for st in steps),
            "trainer/optimizer_steps": len(steps),
            "trainer/step_s": time.perf_counter() - t0,
            "trainer/backward_s": sum(st["backward_s"] for st in steps),
            "trainer/optimizer_s": sum(st["optimizer_s"] for st in steps),
        }

    def _denominator(self, batch: list[TrainSample]) -> float:
        return step_denominator(batch, self.spec.algorithm.normalize)

    def begin_step(self) -> None:
        self._acc = {"loss": 0.0, "kl": 0.0, "clip": 0.0, "entropy": 0.0, "tokens": 0, "seqs": 0,
                     "padded": 0, "micro": 0, "seconds": 0.0, "dropped": 0, "truncated": 0, "value_loss": 0.0,
                     "value_clip": 0.0, "loss_ones": 0.0, "mismatch": algorithms.MismatchSums.zeros(),
                     "backward_s": 0.0, "optimizer_s": 0.0}  # the step's time split (time_breakdown.py)
        # gae in a streamed step: the sums of each arriving part's critic targets (critic_sums)
        self.critic_sums = None
        # gae with algorithm.whiten_advantages in a streamed step (see _side_gradient)
        self._shift: Optional[float] = None
        self._side: dict[str, list[torch.Tensor]] = {}
        # Dropout off in every RL forward: the gradient forward must compute the same
        # function as π_prox's and the engine's, or the ratios carry dropout noise.
        self.engine.module.eval()
        if self.spec.trainer.gradient_checkpointing:
            # Hugging Face checkpoints a decoder layer only while that layer is training: set
            # the flag on the layers alone, their dropout (their children's flags) stays off
            for module in self.engine.module.modules():
                if getattr(module, "gradient_checkpointing", False):
                    module.training = True

    def accumulate(self, batch: list[TrainSample], denominator: float = 1.0, last: bool = False,
                   grad_scale: float = 1.0, min_micro_batches: int = 0) -> None:
        """Forward and backward ``batch`` in packed micro-batches, the loss divided by
        ``denominator``. Data parallel (workers/train/ranks.py): ``denominator`` is the
        whole step's over all ranks, ``grad_scale`` the world size (DeepSpeed *averages*
        gradients over ranks, so each rank's share of the sum is scaled up before), and
        ``min_micro_batches`` the most any rank packs (idle passes fill up the rest)."""
        algo, t0, acc = self.spec.algorithm, time.perf_counter(), self._acc
        correction = algorithms.Correction.of(algo)
        later = False  # the advantages whitened in the gradients at the step's end (see _side_gradient)
        if self.critic is not None and (batch[0].token_advantages is None if batch else not last):
            # a streamed step (schedule.stream_train): the critic values each part as it arrives,
            # with its weights from the step's start (it steps only in finish_step), while the
            # rest still generates. Its advantages stay raw: the whole step's statistics that
            # algorithm.whiten_advantages whitens with are known only in finish_step.
            batch, sums = self.critic_targets(batch, whiten=False)
            self.critic_sums = sums if self.critic_sums is None else {k: self.critic_sums[k] + v
                                                                      for k, v in sums.items()}
            later = algo.whiten_advantages
            if later and (self.spec.trainer.zero_stage != 0 or self.engine.torch_autocast_z0_gradscaler is not None):
                # the spec refuses these; "auto" may still resolve to float16
                raise RuntimeError("whitening a streamed step's advantages needs trainer.zero_stage 0 and a "
                                   "model.dtype other than float16 (or algorithm.whiten_advantages false)")
            if later and self._shift is None and sums["n"] > 0:
                self._shift = sums["a"] / sums["n"]
        lengths = [len(s.prompt_ids) + len(s.token_ids) for s in batch]
        micro = algorithms.pack_first_fit_decreasing(lengths, self.spec.trainer.micro_batch_tokens)
        passes = max(len(micro), min_micro_batches)
        for k in range(passes):
            self.engine.set_gradient_accumulation_boundary(last and k == passes - 1)
            if k >= len(micro):
                self.engine.backward(self._idle_pass(self.engine))
                if self.critic is not None:
                    self.critic.idle_pass(*self._idle_ids(), boundary=last and k == passes - 1)
                continue
            part = [batch[i] for i in micro[k]]
            ids, att, mask, behav, adv, prox = self._tensors(part, self.engine.device)
            logp, entropy = self._logprobs(self.engine, ids, att, with_entropy=True)

            # Decoupled PPO's proximal policy is the policy at the start of the batch. With
            # one optimiser step per batch the current weights *are* the proximal ones
            # (π_prox = π_θ.detach(), exactly, no extra forward); with several, train_step
            # computed π_prox before the first.
            logp_prox = logp.detach() if prox is None else prox

            # The ratios are formed per token, each against that token's own behaviour log-prob
            # (``behav``) and version: an episode whose turns span weight updates needs nothing
            # beyond its mask (observation tokens, log-prob 0.0, are masked out of both losses).
            def policy_loss(advantages):
                if algo.loss == "ppo":
                    return algorithms.ppo_decoupled_loss(logp, logp_prox, behav, advantages, mask, algo.clip,
                                                         algo.behav_weight_cap, denominator, correction)
                return algorithms.reinforce_tis_loss(logp, behav, advantages, mask, algo.behav_weight_cap,
                                                     denominator, correction)

            if later:
                if prox is not None:  # the ratio would not be 1: the loss not linear in the advantages
                    raise RuntimeError("a streamed step reached the trainer with proximal log-probs")
                adv = adv - (self._shift or 0.0)  # padding too: the mask keeps it out
            out = policy_loss(adv)
            loss = out.loss
            if algo.kl_coef > 0 and algo.kl_penalty == "loss":  # ('reward': the advantages carry it)
                if part[0].ref_logprobs is not None:  # from the inference stage
                    ref = self._per_token(part, mask.shape[1], "ref_logprobs").to(self.engine.device)
                elif self.has_reference:
                    ref, _ = self._reference_logprobs(ids, att)
                else:
                    raise RuntimeError("algorithm.kl_reference stage: a sample reached the trainer without its "
                                       "reference log-probs")
                # the policy loss's importance weights carry the stale tokens to π's expectation
                kl = algorithms.kl_penalty(logp, ref, mask, denominator, algo.kl_estimator, weights=out.weights)
                if later:  # its gradient is not scaled by the whitening: kept apart
                    self._side_gradient("kl", algo.kl_coef * kl * grad_scale)
                else:
                    loss = loss + algo.kl_coef * kl
                acc["kl"] += float(kl.detach())
            if later:
                ones = policy_loss(torch.ones_like(adv))
                self._side_gradient("ones", ones.loss * grad_scale)
                acc["loss_ones"] += float(ones.loss.detach())
            t_backward = time.perf_counter()
            self.engine.backward(loss * grad_scale if grad_scale != 1.0 else loss)
            acc["backward_s"] += time.perf_counter() - t_backward
            if self.critic is not None:  # the critic steps with the policy, on the same micro-batches
                columns, device = mask.shape[1], self.engine.device
                value_loss, value_clip = self.critic.accumulate(
                    ids, att, mask, self._per_token(part, columns, "values").to(device),
                    self._per_token(part, columns, "returns").to(device), denominator, last and k == passes - 1,
                    grad_scale=grad_scale)
                acc["value_loss"] += value_loss
                acc["value_clip"] += value_clip * float(mask.sum())
            acc["loss"] += float(out.loss.detach())
            acc["clip"] += out.clip_frac * out.tokens
            acc["entropy"] += float((entropy.detach() * mask).sum())
            acc["tokens"] += out.tokens
            acc["dropped"] += out.dropped
            acc["truncated"] += out.truncated
            acc["mismatch"] = acc["mismatch"].add(algorithms.mismatch_sums(
                logp_prox - behav, mask, self._staleness(part, mask.shape[1])))
            acc["padded"] += ids.numel()
            acc["micro"] += 1
        acc["seqs"] += len(batch)
        acc["seconds"] += time.perf_counter() - t0

    def _optimizer_step(self) -> dict:
        t0 = time.perf_counter()
        self.engine.step()
        if self.critic is not None:
            self.critic.step()
        self._acc["optimizer_s"] += time.perf_counter() - t0
        self._release_cached_memory()
        return self._acc

    def _release_cached_memory(self) -> None:
        """Colocated plans: the engines wake into this GPU after the step, and the blocks
        this process's caching allocator keeps (activations, logits, gradient buckets) are
        not free to them: hand them back to the driver first."""
        if self.spec.resources.colocate and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def finish_step(self, sequences: int, rescale: bool = False,
                    denominator: Optional[float] = None) -> dict[str, float]:
        """``denominator``: of the whole streamed step over all data-parallel ranks (default:
        this trainer's own tokens or ``sequences``)."""
        acc, t0 = self._acc, time.perf_counter()
        how = self.spec.algorithm.normalize
        with contextlib.ExitStack() as steps:
            if rescale:  # streamed step: losses were sums, divide by the now-known denominator
                if denominator is None:
                    denominator = max(1.0, float(acc["tokens"]) if how == "tokens" else float(sequences))
                policy_scale = 1.0
                if self.critic is not None and self.spec.algorithm.whiten_advantages:
                    policy_scale = self._whiten_streamed_gradients()
                self._divide_streamed_gradients(denominator, steps, policy_scale)
                acc["loss"] /= denominator
                acc["kl"] /= denominator
                acc["value_loss"] /= denominator
            self._optimizer_step()
        self.version += 1
        acc["seconds"] += time.perf_counter() - t0
        tokens = max(acc["tokens"], 1)
        critic = ({"critic/value_loss": acc["value_loss"], "critic/value_clip_frac": acc["value_clip"] / tokens}
                  if self.critic is not None else {})
        if self.critic_sums is not None:
            critic |= algorithms.critic_stats(self.critic_sums)
        return {
            **critic,
            "loss/policy": acc["loss"],
            "loss/kl": acc["kl"],
            "policy/clip_frac": acc["clip"] / tokens,
            "policy/behav_dropped_frac": acc["dropped"] / tokens,
            "policy/entropy": acc["entropy"] / tokens,
            **algorithms.mismatch_stats(acc["mismatch"], acc["tokens"], acc["dropped"], acc["truncated"]),
            "trainer/tokens_per_s": acc["padded"] / acc["seconds"],
            "trainer/micro_batches": acc["micro"],
            "trainer/step_s": acc["seconds"],
            "trainer/backward_s": acc["backward_s"],
            "trainer/optimizer_s": acc["optimizer_s"],
        }
