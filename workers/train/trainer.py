"""Trainer: a DeepSpeed engine over the policy (gloo on CPU, NCCL on GPU), the RL
losses, token-budget packing and the weights handed to the rollout engines.

``train_step`` trains one batch: by default one optimiser step, the batch packed into
micro-batches (first-fit-decreasing by padded tokens) whose gradients accumulate, the
loss denominator fixed for the whole step so packing does not change the objective.
With ``algorithm.minibatches`` / ``ppo_epochs``, the batch is split into several
optimiser steps, with the proximal policy of decoupled PPO fixed at the start of the
batch (AReaL): only then does π_θ drift from π_prox, and the clip bind.
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
from workers.train.batching import completion_mask, generated_columns, pad_sequences, per_token
from workers.train.deepspeed_setup import (AUTOCAST_DTYPES, deepspeed_config, forget_earlier_autocast, init_distributed,
                                          limit_heap_fragmentation, partitioned_loading)
from workers.spec import RunSpec, model_dtype
from workers.tasks.model_folder import check_model_folder
from workers.train.samples import (TrainSample, critic_sums_of, kl_in_reward, minibatch_parts, needs_proximal,
                                   step_denominator, whiten_targets, with_critic_targets)
from workers.train.streamed_gradients import StreamedGradients
from workers.train.trainer_weights import TrainerWeights


class Trainer(TrainerWeights, StreamedGradients):
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
        self.reference = None
        # model.lora: the reference is the policy's own module, with the frozen init adapter
        # (model.lora.init) or with its adapters disabled (the base model)
        self.lora_reference = self.lora is not None and algo.kl_coef > 0 and algo.kl_reference == "trainer"
        # (stage: the samples bring log π_ref)
        if algo.kl_coef > 0 and algo.kl_reference == "trainer" and self.lora is None:
            # The same weights and forward as the policy's first: the KL starts at exactly 0. Under
            # autocast that means fp32 weights here too (bf16 ones, rounded, would start it above 0,
            # and Adam's first, sign-like steps then chase the rounding, measured: a 20x larger KL
            # after one step on the tiny model).
            self.reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=load).eval()
            self.reference.requires_grad_(False)
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
        self.critic = None
        self.critic_sums: Optional[dict[str, float]] = None
        if algo.advantage == "gae":
            from workers.train.critic import Critic

            critic_config = deepspeed_config(spec, fp16_supported=bool(accelerator.is_fp16_supported()),
                                             device=accelerator.device_name(), zero_stage=spec.critic.zero_stage)
            forget_earlier_autocast()
            self.critic = Critic(spec, model_path, critic_config, load, self.autocast_dtype, self.device_type)
        self.version = 0
        self.temperature = max(spec.rollout.temperature, 1e-5)

    # -- training ----------------------------------------------------------------
    def _tensors(self, batch: list[TrainSample], device):
        pairs = [(s.prompt_ids, s.token_ids) for s in batch]
        ids, att = pad_sequences(pairs, self.pad_id)
        width = ids.shape[1]
        # an episode's observation tokens are 0: every loss, metric and denominator below counts
        # trained tokens only
        mask = completion_mask(pairs, width - 1, [s.loss_mask for s in batch])
        behav = self._per_token(batch, width - 1, "behav_logprobs")
        prox = self._per_token(batch, width - 1, "prox_logprobs") if batch[0].prox_logprobs is not None else None
        if batch[0].token_advantages is not None:  # GAE: one advantage per token, in the mask's layout
            adv = self._per_token(batch, width - 1, "token_advantages")
        else:
            adv = torch.tensor([s.advantage for s in batch], dtype=torch.float32)
        prox = prox.to(device) if prox is not None else None
        return ids.to(device), att.to(device), mask.to(device), behav.to(device), adv.to(device), prox

    def _staleness(self, batch: list[TrainSample], columns: int) -> torch.Tensor:
        """Each generated token's staleness, the version this step trains from minus the one that
        generated it, as [batch, columns]; -1 where a sample came without its versions."""
        pairs = [(s.prompt_ids, s.token_ids) for s in batch]
        known = [s.versions is not None and len(s.versions) == len(s.token_ids) for s in batch]
        values = [[self.version - v for v in s.versions] if ok else [-1] * len(s.token_ids)
                  for s, ok in zip(batch, known)]
        return per_token(pairs, columns, values)

    @staticmethod
    def _per_token(batch: list[TrainSample], columns: int, field: str) -> torch.Tensor:
        """A per-generated-token field of each sample as [batch, columns], in the mask's layout."""
        return per_token([(s.prompt_ids, s.token_ids) for s in batch], columns, [getattr(s, field) for s in batch])

    def critic_targets(self, batch: list[TrainSample], min_micro_batches: int = 0,
                       counted: Optional[list[int]] = None,
                       whiten: bool = True) -> tuple[list[TrainSample], dict[str, float]]:
        """GAE (algorithm.advantage gae): the critic's values over ``batch`` (a no-grad forward,
        packed like training), and from them and each sequence's reward (on its last token) the
        advantages per token and the returns the critic trains towards. The values are also the
        clipped value loss's old values. Returns the samples with these set, and the sums their
        statistics come from (``critic_stats``; data-parallel ranks add theirs up first).
        ``min_micro_batches``: forwards to run at least, the same number on every rank (ZeRO-3
        gathers the critic's parameters in each). ``counted``: the indices of the samples the
        sums are over (ranks.py ``plan_train``: each sample on one rank only); None: all.
        ``whiten`` False: the advantages stay raw whatever algorithm.whiten_advantages says
        (a streamed step whitens them in its gradients at its end: ``finish_step``)."""
        algo = self.spec.algorithm
        if kl_in_reward(algo) and self.has_reference:  # the rewards need log π_ref before GAE
            batch = self._with_reference_logprobs(batch)
        out = list(batch)

        def targets(i: int, v: list[float]) -> None:
            out[i] = with_critic_targets(batch[i], v, algo)

        # samples the critic stage valued already (critic.forward: stage) need no forward here
        need = [i for i, s in enumerate(batch) if s.values is None]
        for i, s in enumerate(batch):
            if s.values is not None:
                targets(i, list(s.values))
        lengths = [len(batch[i].prompt_ids) + len(batch[i].token_ids) for i in need]
        micro = [[need[k] for k in mb]
                 for mb in algorithms.pack_first_fit_decreasing(lengths, self.spec.trainer.micro_batch_tokens)]
        for mb in micro:
            part = [batch[i] for i in mb]
            ids, att, _, _, _, _ = self._tensors(part, self.engine.device)
            values = self.critic.values(ids, att).cpu()
            for row, (i, s) in enumerate(zip(mb, part)):
                targets(i, values[row, generated_columns(len(s.prompt_ids), len(s.token_ids))].tolist())
        for _ in range(len(micro), min_micro_batches):
            self.critic.values(*self._idle_ids())
        stat = out if counted is None else [out[i] for i in counted]
        sums = critic_sums_of(stat, algo)
        return (whiten_targets(out, sums, algo, self._all_reduce_sum) if whiten else out), sums

    def _all_reduce_sum(self, t: torch.Tensor) -> None:
        """``t`` summed over the data-parallel ranks, in place (nothing to do on one). Every
        rank calls ``critic_targets`` for each step (rank_process.py ``_train``) and for each streamed
        part (``accumulate``, even with an empty share), so the collective always meets."""
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            on = t.to(self.engine.device)
            torch.distributed.all_reduce(on, op=torch.distributed.ReduceOp.SUM)
            t.copy_(on.cpu())

    def _with_reference_logprobs(self, batch: list[TrainSample]) -> list[TrainSample]:
        """``batch`` with log π_ref on the samples that do not bring it (the trainer's
        reference, a no-grad forward packed like training; algorithm.kl_penalty 'reward')."""
        out = list(batch)
        need = [i for i, s in enumerate(batch) if s.ref_logprobs is None]
        lengths = [len(batch[i].prompt_ids) + len(batch[i].token_ids) for i in need]
        with torch.no_grad():
            for mb in algorithms.pack_first_fit_decreasing(lengths, self.spec.trainer.micro_batch_tokens):
                part = [batch[need[k]] for k in mb]
                ids, att, _, _, _, _ = self._tensors(part, self.engine.device)
                ref, _ = self._reference_logprobs(ids, att)
                for row, (k, s) in enumerate(zip(mb, part)):
                    cols = generated_columns(len(s.prompt_ids), len(s.token_ids))
                    out[need[k]] = dataclasses.replace(s, ref_logprobs=ref[row, cols].float().cpu().tolist())
        return out

    @property
    def has_reference(self) -> bool:
        """The trainer computes log π_ref itself (algorithm.kl_reference 'trainer')."""
        return self.reference is not None or self.lora_reference

    def _reference_logprobs(self, ids, att):
        """log π_ref: the reference model's, or with model.lora the run's starting policy on
        the policy's own module (the frozen init adapter, or the base model: lora.reference_logprobs)."""
        if self.lora_reference:
            from workers.train.lora import reference_logprobs

            return reference_logprobs(self, ids, att)
        with torch.no_grad():
            return self._logprobs(self.reference, ids, att)

    def _autocast(self):
        """The training forward's precision for forwards outside the engine (π_prox, the
        reference, idle passes): under autocast, the same low-precision matmuls."""
        import contextlib

        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def _logprobs(self, model, ids, att, with_entropy: bool = False, truncate: bool = True):
        """Each next token's log-prob, from the distribution the engine samples from: the
        logits over the temperature, then the rollout's top-k/top-p truncation (vLLM's
        processed log-probs), so that an on-policy token's importance weight is 1."""
        with self._autocast():
            logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float() / self.temperature
        rollout = self.spec.rollout
        return algorithms.token_logprobs(logits, ids[:, 1:], top_k=rollout.top_k if truncate else -1,
                                         top_p=rollout.top_p if truncate else 1.0, with_entropy=with_entropy)

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

    def _idle_pass(self, model) -> torch.Tensor:
        """A forward of two padding tokens, its output multiplied by zero: a data-parallel
        rank with fewer micro-batches than its peers runs these so that every rank enters
        the same per-forward (ZeRO-3 gathers) and per-backward (ZeRO-2/3 reduces) collectives."""
        ids, att = self._idle_ids()
        logp, _ = self._logprobs(model, ids, att)
        return logp.sum() * 0.0

    def _idle_ids(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.engine.device)
        return ids, torch.ones_like(ids)

    def proximal_logprobs(self, batch: list[TrainSample], min_micro_batches: int = 0) -> list[list[float]]:
        """π_prox: each sampled token's log-prob under the weights at the start of the batch
        (a no-grad forward, packed like training). ``min_micro_batches``: forwards to run
        at least (idle ones after the real ones), the same number on every rank."""
        self.engine.module.eval()
        lengths = [len(s.prompt_ids) + len(s.token_ids) for s in batch]
        out: list[list[float]] = [[] for _ in batch]
        micro = algorithms.pack_first_fit_decreasing(lengths, self.spec.trainer.micro_batch_tokens)
        with torch.no_grad():
            for mb in micro:
                part = [batch[i] for i in mb]
                ids, att, mask, _, _, _ = self._tensors(part, self.engine.device)
                logp, _ = self._logprobs(self.engine.module, ids, att)
                for row, (i, s) in enumerate(zip(mb, part)):
                    out[i] = logp[row, generated_columns(len(s.prompt_ids), len(s.token_ids))].float().cpu().tolist()
            for _ in range(len(micro), min_micro_batches):
                self._idle_pass(self.engine.module)
        return out

    # A step in pieces, so micro-batches can start while the batch is still arriving
    # (stream training): accumulate() with denominator 1 sums the losses, and
    # finish_step(rescale=True) divides the gradients by the step's denominator once it
    # is known — the same step as train_step on the whole batch.
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
