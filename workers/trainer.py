"""Trainer: a DeepSpeed engine over the policy (gloo on CPU, NCCL on GPU), the RL
losses, token-budget packing and the weights handed to the rollout engines.

One optimiser step per call of ``train_step``: the batch is packed into micro-batches
(first-fit-decreasing by padded tokens), gradients accumulate over them, and the loss
denominator is fixed for the whole step so packing does not change the objective.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import torch

from . import algorithms
from .spec import RunSpec
from .tinymodel import PAD_ID


@dataclass
class TrainSample:
    prompt_ids: list[int]
    token_ids: list[int]
    behav_logprobs: list[float]
    advantage: float


def _init_distributed() -> None:
    import deepspeed

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:  # a free port, so several runs can share a machine
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend)


class Trainer:
    def __init__(self, spec: RunSpec, model_path: str, threads: Optional[int] = None):
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        import deepspeed
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.spec = spec
        self.model_path = model_path
        algo = spec.algorithm
        _init_distributed()
        torch.manual_seed(spec.seed)
        dtype = getattr(torch, spec.model.dtype)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.reference = None
        if algo.kl_coef > 0:
            self.reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
            self.reference.requires_grad_(False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=algo.lr, weight_decay=algo.weight_decay)
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,  # we mark accumulation boundaries ourselves
            "gradient_clipping": algo.grad_clip,
            "zero_optimization": {"stage": spec.trainer.zero_stage},
            "bf16": {"enabled": spec.model.dtype == "bfloat16"},
            "steps_per_print": 10**9,
        }
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        self.version = 0
        self.temperature = max(spec.rollout.temperature, 1e-5)

    # -- weights -----------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.engine.module.state_dict()

    def save(self, path: str) -> None:
        """A complete HF folder (weights + the tokenizer files) that vLLM can load."""
        import shutil

        self.engine.module.save_pretrained(path, safe_serialization=True)
        for name in os.listdir(self.model_path):
            if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                shutil.copy(os.path.join(self.model_path, name), path)

    # -- training ----------------------------------------------------------------
    def _tensors(self, batch: list[TrainSample], device):
        width = max(len(s.prompt_ids) + len(s.token_ids) for s in batch)
        n = len(batch)
        ids = torch.full((n, width), PAD_ID, dtype=torch.long)
        att = torch.zeros((n, width), dtype=torch.long)
        mask = torch.zeros((n, width - 1))
        behav = torch.zeros((n, width - 1))
        for i, s in enumerate(batch):
            seq = s.prompt_ids + s.token_ids
            ids[i, : len(seq)] = torch.tensor(seq)
            att[i, : len(seq)] = 1
            p = len(s.prompt_ids)
            # position t predicts token t+1: generated tokens sit at p..p+len-1
            mask[i, p - 1 : p - 1 + len(s.token_ids)] = 1
            behav[i, p - 1 : p - 1 + len(s.token_ids)] = torch.tensor(s.behav_logprobs, dtype=torch.float32)
        adv = torch.tensor([s.advantage for s in batch], dtype=torch.float32)
        return ids.to(device), att.to(device), mask.to(device), behav.to(device), adv.to(device)

    def _logprobs(self, model, ids, att, with_entropy: bool = False):
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float() / self.temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
        return logp, entropy

    def train_step(self, batch: list[TrainSample]) -> dict[str, float]:
        algo, t0 = self.spec.algorithm, time.perf_counter()
        device = self.engine.device
        lengths = [len(s.prompt_ids) + len(s.token_ids) for s in batch]
        micro = algorithms.pack_first_fit_decreasing(lengths, self.spec.trainer.micro_batch_tokens)
        tensors = [self._tensors([batch[i] for i in mb], device) for mb in micro]
        total_mask = sum(float(t[2].sum()) for t in tensors)
        denominator = total_mask if algo.normalize == "tokens" else float(len(batch))
        denominator = max(denominator, 1.0)

        # Decoupled PPO's proximal policy is the policy at the start of this step. All
        # micro-batches accumulate into one optimiser step, so during the forward passes
        # the current weights *are* the proximal ones: π_prox = π_θ.detach(), exactly, and
        # the separate no-grad forward AReaL needs for several minibatch updates per batch
        # would recompute the same numbers.
        self.engine.module.train()

        stats = {"loss": 0.0, "kl": 0.0, "clip": 0.0, "entropy": 0.0, "tokens": 0}
        for k, (ids, att, mask, behav, adv) in enumerate(tensors):
            self.engine.set_gradient_accumulation_boundary(k == len(tensors) - 1)
            logp, entropy = self._logprobs(self.engine, ids, att, with_entropy=True)
            if algo.loss == "ppo":
                out = algorithms.ppo_decoupled_loss(logp, logp.detach(), behav, adv, mask, algo.clip, algo.behav_weight_cap, denominator)
            else:
                out = algorithms.reinforce_tis_loss(logp, behav, adv, mask, algo.behav_weight_cap, denominator)
            loss = out.loss
            if self.reference is not None:
                with torch.no_grad():
                    ref, _ = self._logprobs(self.reference, ids, att)
                kl = algorithms.kl_penalty(logp, ref, mask, denominator)
                loss = loss + algo.kl_coef * kl
                stats["kl"] += float(kl)
            self.engine.backward(loss)
            stats["loss"] += float(out.loss.detach())
            stats["clip"] += out.clip_frac * out.tokens
            stats["entropy"] += float((entropy.detach() * mask).sum())
            stats["tokens"] += out.tokens
        self.engine.step()
        self.version += 1
        seconds = time.perf_counter() - t0
        tokens = max(stats["tokens"], 1)
        return {
            "loss/policy": stats["loss"],
            "loss/kl": stats["kl"],
            "policy/clip_frac": stats["clip"] / tokens,
            "policy/entropy": stats["entropy"] / tokens,
            "trainer/tokens_per_s": sum(lengths) / seconds,
            "trainer/micro_batches": len(micro),
            "trainer/step_s": seconds,
        }
