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
    if "MASTER_PORT" not in os.environ or os.environ["WORLD_SIZE"] == "1":
        # A single process is its own rendezvous: take a free port, even over an inherited
        # MASTER_PORT — a parent that trained in-process still listens on that one
        # (EADDRINUSE), and several runs share a machine.
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not torch.cuda.is_available() and os.environ["WORLD_SIZE"] == "1":
        # One CPU process needs no shared-memory all-reduce. DeepSpeed would otherwise JIT-build
        # that op under a lock file in ~/.cache/torch_extensions, and a process killed during
        # the build leaves the lock behind: every later run then waits on it forever.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend)


class Trainer:
    def __init__(self, spec: RunSpec, model_path: str, threads: Optional[int] = None, pad_id: int = 0):
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        import deepspeed
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.spec = spec
        self.model_path = model_path
        self.pad_id = pad_id  # any id: padded positions are masked out of attention and loss
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
        warmup = algo.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)))
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                    lr_scheduler=scheduler)
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
            if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template", "added_tokens",
                                "spiece", "sentencepiece")):
                shutil.copy(os.path.join(self.model_path, name), path)

    # -- checkpoints (workers/checkpoint.py) ------------------------------------------
    # DeepSpeed's own checkpoint: module, optimiser (whatever wraps it at this ZeRO stage
    # and dtype) and scheduler states, restored exactly by load_state.
    def save_state(self, folder: str) -> None:
        self.engine.save_checkpoint(folder, tag="ds", client_state={"fluxrl_version": self.version},
                                    save_latest=False)

    def load_state(self, folder: str) -> int:
        """Restore a save_state folder; returns (and takes) the policy version saved."""
        path, client = self.engine.load_checkpoint(folder, tag="ds", load_optimizer_states=True,
                                                   load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {folder}")
        self.version = int(client["fluxrl_version"])
        return self.version

    # -- training ----------------------------------------------------------------
    def _tensors(self, batch: list[TrainSample], device):
        width = max(len(s.prompt_ids) + len(s.token_ids) for s in batch)
        n = len(batch)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
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
        """One optimiser step on a whole batch (the denominator is known up front)."""
        mask_tokens = sum(len(s.token_ids) for s in batch)
        denominator = mask_tokens if self.spec.algorithm.normalize == "tokens" else len(batch)
        self.begin_step()
        self.accumulate(batch, denominator=max(1.0, float(denominator)), last=True)
        return self.finish_step(len(batch))

    # A step in pieces, so micro-batches can start while the batch is still arriving
    # (stream training): accumulate() with denominator 1 sums the losses, and
    # finish_step(rescale=True) divides the gradients by the step's denominator once it
    # is known — the same step as train_step on the whole batch.
    def begin_step(self) -> None:
        self._acc = {"loss": 0.0, "kl": 0.0, "clip": 0.0, "entropy": 0.0, "tokens": 0, "seqs": 0,
                     "padded": 0, "micro": 0, "seconds": 0.0}
        self.engine.module.train()

    def accumulate(self, batch: list[TrainSample], denominator: float = 1.0, last: bool = False) -> None:
        algo, t0, acc = self.spec.algorithm, time.perf_counter(), self._acc
        lengths = [len(s.prompt_ids) + len(s.token_ids) for s in batch]
        micro = algorithms.pack_first_fit_decreasing(lengths, self.spec.trainer.micro_batch_tokens)
        for k, mb in enumerate(micro):
            ids, att, mask, behav, adv = self._tensors([batch[i] for i in mb], self.engine.device)
            self.engine.set_gradient_accumulation_boundary(last and k == len(micro) - 1)
            logp, entropy = self._logprobs(self.engine, ids, att, with_entropy=True)
            # Decoupled PPO's proximal policy is the policy at the start of this step. All
            # micro-batches accumulate into one optimiser step, so during these forwards the
            # current weights *are* the proximal ones: π_prox = π_θ.detach(), exactly; the
            # extra no-grad forward AReaL needs for several minibatch updates per batch
            # would recompute the same numbers.
            if algo.loss == "ppo":
                out = algorithms.ppo_decoupled_loss(logp, logp.detach(), behav, adv, mask, algo.clip,
                                                    algo.behav_weight_cap, denominator)
            else:
                out = algorithms.reinforce_tis_loss(logp, behav, adv, mask, algo.behav_weight_cap, denominator)
            loss = out.loss
            if self.reference is not None:
                with torch.no_grad():
                    ref, _ = self._logprobs(self.reference, ids, att)
                kl = algorithms.kl_penalty(logp, ref, mask, denominator)
                loss = loss + algo.kl_coef * kl
                acc["kl"] += float(kl.detach())
            self.engine.backward(loss)
            acc["loss"] += float(out.loss.detach())
            acc["clip"] += out.clip_frac * out.tokens
            acc["entropy"] += float((entropy.detach() * mask).sum())
            acc["tokens"] += out.tokens
            acc["padded"] += ids.numel()
            acc["micro"] += 1
        acc["seqs"] += len(batch)
        acc["seconds"] += time.perf_counter() - t0

    def finish_step(self, sequences: int, rescale: bool = False) -> dict[str, float]:
        acc, t0 = self._acc, time.perf_counter()
        how = self.spec.algorithm.normalize
        if rescale:  # streamed step: losses were sums, divide by the now-known denominator
            denominator = max(1.0, float(acc["tokens"]) if how == "tokens" else float(sequences))
            with torch.no_grad():
                for p in self.engine.module.parameters():
                    if p.grad is not None:
                        p.grad.div_(denominator)
            self.engine.set_gradient_accumulation_boundary(True)
            if torch.distributed.get_world_size() > 1:
                self.engine.allreduce_gradients()
            acc["loss"] /= denominator
            acc["kl"] /= denominator
        self.engine.step()
        self.version += 1
        acc["seconds"] += time.perf_counter() - t0
        tokens = max(acc["tokens"], 1)
        return {
            "loss/policy": acc["loss"],
            "loss/kl": acc["kl"],
            "policy/clip_frac": acc["clip"] / tokens,
            "policy/entropy": acc["entropy"] / tokens,
            "trainer/tokens_per_s": acc["padded"] / acc["seconds"],
            "trainer/micro_batches": acc["micro"],
            "trainer/step_s": acc["seconds"],
        }
