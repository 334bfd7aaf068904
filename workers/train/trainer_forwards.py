"""The trainer's no-grad forwards: the critic's values and from them GAE's targets, π_prox
(the proximal log-probs), the reference's log-probs, and the idle passes that keep
data-parallel ranks in step; with the samples as padded tensors, the log-prob forward they
and training share, and the loading of the models they run beside the policy (the
reference, the critic). A mixin of ``Trainer`` (workers/train/trainer.py), whose engine,
spec and precision it reads."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from workers.train import algorithms
from workers.train.batching import completion_mask, generated_columns, pad_sequences, per_token
from workers.train.deepspeed_setup import deepspeed_config, forget_earlier_autocast
from workers.train.samples import TrainSample, critic_sums_of, kl_in_reward, whiten_targets, with_critic_targets


class TrainerForwards:
    # -- the models beside the policy ------------------------------------------------------
    def _load_reference(self, model_path: str, load: torch.dtype) -> None:
        """The reference policy (algorithm.kl_reference 'trainer'), in ``load``'s dtype, on the
        CPU (``Trainer.__init__`` moves it to the engine's device)."""
        from transformers import AutoModelForCausalLM

        algo = self.spec.algorithm
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

    def _load_critic(self, model_path: str, accelerator, load: torch.dtype) -> None:
        """The critic (algorithm.advantage gae): a DeepSpeed engine of its own (workers/train/critic.py)."""
        spec, algo = self.spec, self.spec.algorithm
        self.critic = None
        if algo.advantage == "gae":
            from workers.train.critic import Critic

            critic_config = deepspeed_config(spec, fp16_supported=bool(accelerator.is_fp16_supported()),
                                             device=accelerator.device_name(), zero_stage=spec.critic.zero_stage)
            forget_earlier_autocast()
            self.critic = Critic(spec, model_path, critic_config, load, self.autocast_dtype, self.device_type)

    # -- the samples as tensors, and the log-prob forward -------------------------------
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
