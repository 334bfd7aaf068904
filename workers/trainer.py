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
    prox_logprobs: Optional[list[float]] = None  # π_prox per token; None: the current weights


def step_denominator(batch: list[TrainSample], normalize: str) -> float:
    """The loss denominator of one optimiser step over ``batch``: its trained tokens or sequences."""
    return max(1.0, float(sum(len(s.token_ids) for s in batch) if normalize == "tokens" else len(batch)))


def minibatch_parts(n: int, minibatches: int, ppo_epochs: int, seed: int, version: int) -> list[list[int]]:
    """The optimiser steps of one batch of ``n`` samples: indices per step, each epoch a
    fresh shuffle dealt round-robin into ``minibatches``. Shared with the data-parallel
    trainer (workers/trainer_ranks.py), whose ranks must step on the same minibatches."""
    gen = torch.Generator().manual_seed(seed * 100_003 + version)
    parts = []
    for _ in range(ppo_epochs):
        order = torch.randperm(n, generator=gen).tolist()
        parts.extend(p for p in (order[k::minibatches] for k in range(minibatches)) if p)
    return parts


def _init_distributed() -> None:
    import deepspeed

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not torch.cuda.is_available():
        # No shared-memory all-reduce on gloo ranks: DeepSpeed uses it only for inference
        # all-reduce (training goes through torch.distributed either way), and it would JIT-build
        # the op under a lock file in ~/.cache/torch_extensions; a process killed during the
        # build leaves the lock behind, and every later run then waits on it forever.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not torch.distributed.is_initialized():
        _init_world(backend)
    # DeepSpeed finds the group initialised and only wraps it (deepspeed/comm/comm.py)
    deepspeed.init_distributed(dist_backend=backend)


def _init_world(backend: str) -> None:
    """The DeepSpeed world's process group, on a store we bind ourselves: env:// would make
    rank 0's store listen on every interface, open to anyone on the network."""
    import torch.distributed as dist
    from deepspeed.constants import default_pg_timeout

    from .stores import interface_of, is_loopback, master_store

    addr, rank, world = os.environ["MASTER_ADDR"], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world == 1:
        # A single process is its own rendezvous: an in-memory store, no socket at all
        # (several runs share a machine, and a parent that trained in-process holds ports).
        store = dist.HashStore()
    elif rank == 0:
        store = master_store(addr, int(os.environ["MASTER_PORT"]), world, default_pg_timeout)
    else:
        store = dist.TCPStore(addr, int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=default_pg_timeout)
    if backend == "gloo" and world > 1 and is_loopback(addr) and "GLOO_SOCKET_IFNAME" not in os.environ:
        # One machine: gloo's own pair sockets (of this group and DeepSpeed's later ones) on
        # loopback too, not on whatever the hostname resolves to. Only in a rank's process,
        # whose environment is its own; one in-process trainer has no peer to listen for.
        interface = interface_of(addr)
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    kwargs = {}
    if backend == "nccl" and world > 1:  # as DeepSpeed's own init does: bind the group to this rank's device
        kwargs["device_id"] = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=default_pg_timeout,
                            **kwargs)


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
        total = spec.stop.max_steps * algo.minibatches * algo.ppo_epochs  # optimiser steps in the whole run
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: algorithms.lr_factor(
            s, algo.warmup_steps, algo.lr_decay, total, algo.lr_floor))
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                    lr_scheduler=scheduler)
        if self.reference is not None:
            # The reference's log-probs meet the policy's input ids, on the engine's device
            # (cuda:LOCAL_RANK on a GPU; DeepSpeed moved only the policy there).
            self.reference.to(self.engine.device)
        self.version = 0
        self.temperature = max(spec.rollout.temperature, 1e-5)

    # -- weights -----------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors, on the CPU, whatever the ZeRO stage: under ZeRO-3 each rank holds
        only its shard (the module's parameters are empty placeholders), so they are
        gathered first. Every rank must call this (the gather is a collective)."""
        module = self.engine.module
        if self.spec.trainer.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}

    def save(self, path: str) -> None:
        """A complete HF folder (weights + the tokenizer files) that vLLM can load."""
        import shutil

        state = self.state_dict()
        self.engine.module.save_pretrained(path, state_dict=state, safe_serialization=True)
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
        prox = torch.zeros((n, width - 1)) if batch[0].prox_logprobs is not None else None
        for i, s in enumerate(batch):
            seq = s.prompt_ids + s.token_ids
            ids[i, : len(seq)] = torch.tensor(seq)
            att[i, : len(seq)] = 1
            p = len(s.prompt_ids)
            # position t predicts token t+1: generated tokens sit at p..p+len-1
            mask[i, p - 1 : p - 1 + len(s.token_ids)] = 1
            behav[i, p - 1 : p - 1 + len(s.token_ids)] = torch.tensor(s.behav_logprobs, dtype=torch.float32)
            if prox is not None:
                prox[i, p - 1 : p - 1 + len(s.token_ids)] = torch.tensor(s.prox_logprobs, dtype=torch.float32)
        adv = torch.tensor([s.advantage for s in batch], dtype=torch.float32)
        prox = prox.to(device) if prox is not None else None
        return ids.to(device), att.to(device), mask.to(device), behav.to(device), adv.to(device), prox

    def _logprobs(self, model, ids, att, with_entropy: bool = False):
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float() / self.temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
        return logp, entropy

    def train_step(self, batch: list[TrainSample]) -> dict[str, float]:
        """Train on a whole batch: one optimiser step, or ``minibatches`` × ``ppo_epochs``
        of them; the policy version advances once either way."""
        algo = self.spec.algorithm
        if algo.minibatches == 1 and algo.ppo_epochs == 1:
            self.begin_step()
            self.accumulate(batch, denominator=self._denominator(batch), last=True)
            return self.finish_step(len(batch))
        t0 = time.perf_counter()
        prox = self.proximal_logprobs(batch)
        batch = [TrainSample(s.prompt_ids, s.token_ids, s.behav_logprobs, s.advantage, p) for s, p in zip(batch, prox)]
        steps = []
        for part in minibatch_parts(len(batch), algo.minibatches, algo.ppo_epochs, self.spec.seed, self.version):
            minibatch = [batch[i] for i in part]
            self.begin_step()
            self.accumulate(minibatch, denominator=self._denominator(minibatch), last=True)
            steps.append(self._optimizer_step())
        self.version += 1
        tokens = sum(st["tokens"] for st in steps) or 1
        return {
            "loss/policy": sum(st["loss"] for st in steps) / len(steps),
            "loss/kl": sum(st["kl"] for st in steps) / len(steps),
            "policy/clip_frac": sum(st["clip"] for st in steps) / tokens,
            "policy/entropy": sum(st["entropy"] for st in steps) / tokens,
            "trainer/tokens_per_s": sum(st["padded"] for st in steps) / (time.perf_counter() - t0),
            "trainer/micro_batches": sum(st["micro"] for st in steps),
            "trainer/optimizer_steps": len(steps),
            "trainer/step_s": time.perf_counter() - t0,
        }

    def _denominator(self, batch: list[TrainSample]) -> float:
        return step_denominator(batch, self.spec.algorithm.normalize)

    def _idle_pass(self, model) -> torch.Tensor:
        """A forward of two padding tokens, its output multiplied by zero: a data-parallel
        rank with fewer micro-batches than its peers runs these so that every rank enters
        the same per-forward (ZeRO-3 gathers) and per-backward (ZeRO-2/3 reduces) collectives."""
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.engine.device)
        logp, _ = self._logprobs(model, ids, torch.ones_like(ids))
        return logp.sum() * 0.0

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
                    p = len(s.prompt_ids)
                    out[i] = logp[row, p - 1 : p - 1 + len(s.token_ids)].float().cpu().tolist()
            for _ in range(len(micro), min_micro_batches):
                self._idle_pass(self.engine.module)
        return out

    # A step in pieces, so micro-batches can start while the batch is still arriving
    # (stream training): accumulate() with denominator 1 sums the losses, and
    # finish_step(rescale=True) divides the gradients by the step's denominator once it
    # is known — the same step as train_step on the whole batch.
    def begin_step(self) -> None:
        self._acc = {"loss": 0.0, "kl": 0.0, "clip": 0.0, "entropy": 0.0, "tokens": 0, "seqs": 0,
                     "padded": 0, "micro": 0, "seconds": 0.0}
        self.engine.module.train()

    def accumulate(self, batch: list[TrainSample], denominator: float = 1.0, last: bool = False,
                   grad_scale: float = 1.0, min_micro_batches: int = 0) -> None:
        """Forward and backward ``batch`` in packed micro-batches, the loss divided by
        ``denominator``. Data parallel (workers/trainer_ranks.py): ``denominator`` is the
        whole step's over all ranks, ``grad_scale`` the world size (DeepSpeed *averages*
        gradients over ranks, so each rank's share of the sum is scaled up before), and
        ``min_micro_batches`` the most any rank packs (idle passes fill up the rest)."""
        algo, t0, acc = self.spec.algorithm, time.perf_counter(), self._acc
        lengths = [len(s.prompt_ids) + len(s.token_ids) for s in batch]
        micro = algorithms.pack_first_fit_decreasing(lengths, self.spec.trainer.micro_batch_tokens)
        passes = max(len(micro), min_micro_batches)
        for k in range(passes):
            self.engine.set_gradient_accumulation_boundary(last and k == passes - 1)
            if k >= len(micro):
                self.engine.backward(self._idle_pass(self.engine))
                continue
            mb = micro[k]
            ids, att, mask, behav, adv, prox = self._tensors([batch[i] for i in mb], self.engine.device)
            logp, entropy = self._logprobs(self.engine, ids, att, with_entropy=True)
            # Decoupled PPO's proximal policy is the policy at the start of the batch. With
            # one optimiser step per batch the current weights *are* the proximal ones
            # (π_prox = π_θ.detach(), exactly, no extra forward); with several, train_step
            # computed π_prox before the first.
            if algo.loss == "ppo":
                out = algorithms.ppo_decoupled_loss(logp, logp.detach() if prox is None else prox, behav, adv, mask,
                                                    algo.clip, algo.behav_weight_cap, denominator)
            else:
                out = algorithms.reinforce_tis_loss(logp, behav, adv, mask, algo.behav_weight_cap, denominator)
            loss = out.loss
            if self.reference is not None:
                with torch.no_grad():
                    ref, _ = self._logprobs(self.reference, ids, att)
                kl = algorithms.kl_penalty(logp, ref, mask, denominator)
                loss = loss + algo.kl_coef * kl
                acc["kl"] += float(kl.detach())
            self.engine.backward(loss * grad_scale if grad_scale != 1.0 else loss)
            acc["loss"] += float(out.loss.detach())
            acc["clip"] += out.clip_frac * out.tokens
            acc["entropy"] += float((entropy.detach() * mask).sum())
            acc["tokens"] += out.tokens
            acc["padded"] += ids.numel()
            acc["micro"] += 1
        acc["seqs"] += len(batch)
        acc["seconds"] += time.perf_counter() - t0

    def _optimizer_step(self) -> dict:
        self.engine.step()
        return self._acc

    def finish_step(self, sequences: int, rescale: bool = False,
                    denominator: Optional[float] = None) -> dict[str, float]:
        """``denominator``: of the whole streamed step over all data-parallel ranks (default:
        this trainer's own tokens or ``sequences``)."""
        acc, t0 = self._acc, time.perf_counter()
        how = self.spec.algorithm.normalize
        if rescale:  # streamed step: losses were sums, divide by the now-known denominator
            if denominator is None:
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
        self._optimizer_step()
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
