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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from workers.train import algorithms
from workers.train.batching import completion_mask, generated_columns, pad_sequences, per_token
from workers.train.deepspeed_setup import (AUTOCAST_DTYPES, deepspeed_config, forget_earlier_autocast, init_distributed,
                                          limit_heap_fragmentation, partitioned_loading)
from workers.spec import RunSpec, model_dtype
from workers.tasks.model_folder import check_model_folder

if TYPE_CHECKING:
    from workers.weights.files import WeightFile


@dataclass
class TrainSample:
    prompt_ids: list[int]
    token_ids: list[int]
    behav_logprobs: list[float]
    advantage: float
    prox_logprobs: Optional[list[float]] = None  # π_prox per token; None: the current weights
    # algorithm.advantage gae: the sequence's reward, and what the critic made of it per token
    # (set by Trainer.critic_targets; ``advantage`` is then unused)
    reward: float = 0.0
    # the critic's values the targets came from ("old values"); set before the step when the
    # critic's forward runs in the inference stage (critic.forward: stage, workers/train/value_stage.py)
    values: Optional[list[float]] = None
    returns: Optional[list[float]] = None  # the critic's targets (λ-returns)
    token_advantages: Optional[list[float]] = None  # GAE per token
    # algorithm.kl_reference stage: log π_ref per token, from the inference stage (workers/train/reference.py)
    ref_logprobs: Optional[list[float]] = None
    # the policy version that generated each token: the mismatch metrics split by staleness with it
    versions: Optional[list[int]] = None
    # an episode (task.environment): 1 on each generated token, 0 on each observation token,
    # which no loss, metric or denominator counts; None: every token is trained
    loss_mask: Optional[list[int]] = None
    # an episode under GAE: the reward of each token (turn rewards on each turn's last generated
    # token, the final score on the last: workers/agents/episode.py token_rewards); None: ``reward``
    # on the last token
    token_rewards: Optional[list[float]] = None

    @property
    def trained_tokens(self) -> int:
        return len(self.token_ids) if self.loss_mask is None else sum(1 for m in self.loss_mask if m)


def step_denominator(batch: list[TrainSample], normalize: str) -> float:
    """The loss denominator of one optimiser step over ``batch``: its trained tokens (an
    episode's observation tokens are not) or sequences."""
    return max(1.0, float(sum(s.trained_tokens for s in batch) if normalize == "tokens" else len(batch)))


def needs_proximal(parts: list[list[int]], n: int) -> list[bool]:
    """Which of ``n`` samples need π_prox computed before the batch's first optimiser step:
    those a later step trains on. The first step starts from the weights π_prox is, so its
    own samples take π_prox from their training forward, detached (as a one-step batch
    does): with one epoch that forward is not run twice."""
    later = {i for part in parts[1:] for i in part}
    return [i in later for i in range(n)]


def minibatch_parts(n: int, minibatches: int, ppo_epochs: int, seed: int, version: int) -> list[list[int]]:
    """The optimiser steps of one batch of ``n`` samples: indices per step, each epoch a
    fresh shuffle dealt round-robin into ``minibatches``. Shared with the data-parallel
    trainer (workers/train/ranks.py), whose ranks must step on the same minibatches."""
    gen = torch.Generator().manual_seed(seed * 100_003 + version)
    parts = []
    for _ in range(ppo_epochs):
        order = torch.randperm(n, generator=gen).tolist()
        parts.extend(p for p in (order[k::minibatches] for k in range(minibatches)) if p)
    return parts


def kl_in_reward(algo) -> bool:
    """algorithm.kl_penalty 'reward' with a KL to pay: the per-token rewards carry it, the loss does not."""
    return algo.kl_coef > 0 and algo.kl_penalty == "reward"


def charged_kl(batch: list[TrainSample], algo) -> Optional[list[list[float]]]:
    """algorithm.kl_penalty 'reward': each sample's per-token log π_old − log π_ref, the KL its
    rewards were charged (for the metric reward/kl); None otherwise."""
    if not kl_in_reward(algo):
        return None
    return [[o - r for o, r in zip(s.behav_logprobs, s.ref_logprobs)] for s in batch]


def with_critic_targets(sample: TrainSample, values: list[float], algo) -> TrainSample:
    """``sample`` with the critic's ``values`` and, from them and its reward (on its last
    token; with algorithm.kl_penalty 'reward' also −kl_coef·(log π_old − log π_ref) on every
    token, π_old the behaviour policy), GAE's per-token advantages (raw: ``whiten_targets``
    whitens them over the batch) and the returns the critic trains towards.

    An episode (``loss_mask``): GAE runs over its generated tokens alone, in order, as one
    sequence of actions. The observation between two turns is part of the environment's
    transition, not an action: the value after a turn's last token is the value before the
    next turn's first. Each turn's reward sits on that turn's last generated token, the final
    score on the episode's last (``token_rewards``); observation tokens get advantage 0 and
    their value as return (masked out of every loss)."""
    trained = [k for k in range(len(sample.token_ids)) if sample.loss_mask is None or sample.loss_mask[k]]
    if kl_in_reward(algo):
        if sample.ref_logprobs is None:
            raise RuntimeError("algorithm.kl_penalty 'reward': a sample reached GAE without its reference log-probs")
        rewards = algorithms.kl_rewards(0.0 if sample.token_rewards is not None else sample.reward,
                                        [sample.behav_logprobs[k] for k in trained],
                                        [sample.ref_logprobs[k] for k in trained], algo.kl_coef)
    else:
        rewards = algorithms.terminal_rewards(0.0 if sample.token_rewards is not None else sample.reward,
                                              len(trained))
    if sample.token_rewards is not None:
        rewards = [r + sample.token_rewards[k] for r, k in zip(rewards, trained)]
    adv_t, ret_t = algorithms.gae(rewards, [values[k] for k in trained], algo.gamma, algo.lam)
    if len(trained) == len(sample.token_ids):
        adv, ret = adv_t, ret_t
    else:
        adv, ret = [0.0] * len(sample.token_ids), [float(v) for v in values]
        for k, a, r in zip(trained, adv_t, ret_t):
            adv[k], ret[k] = a, r
    return dataclasses.replace(sample, values=values, returns=ret, token_advantages=adv)


def trained_only(samples: list[TrainSample], field: str) -> list[Optional[list[float]]]:
    """A per-token field of each sample over its trained tokens only (an episode's
    observation tokens left out of the statistics)."""
    out = []
    for s in samples:
        values = getattr(s, field)
        out.append(values if values is None or s.loss_mask is None
                   else [v for v, m in zip(values, s.loss_mask) if m])
    return out


def critic_sums_of(samples: list[TrainSample], algo) -> dict[str, float]:
    """``algorithms.critic_sums`` over the samples' trained tokens."""
    kl = charged_kl(samples, algo)
    if kl is not None:
        kl = [k if s.loss_mask is None else [v for v, m in zip(k, s.loss_mask) if m] for k, s in zip(kl, samples)]
    return algorithms.critic_sums(trained_only(samples, "values"), trained_only(samples, "returns"),
                                  trained_only(samples, "token_advantages"), kl)


def whiten_targets(batch: list[TrainSample], sums: dict[str, float], algo, all_reduce=None) -> list[TrainSample]:
    """algorithm.whiten_advantages: the samples' GAE advantages whitened over every generated
    token of them, (A − mean) / (std + 1e-8); the returns (the critic's targets) stay raw.
    ``sums``: ``critic_sums`` of ``batch`` (its raw advantages' count, sum and sum of squares).
    ``all_reduce``: adds up (in place) a float64 tensor of those three over the data-parallel
    ranks, each of which holds its share of the batch, so all whiten with the whole batch's
    statistics."""
    if not algo.whiten_advantages:
        return batch
    mean, std = whitening_moments(sums, all_reduce)
    adv = algorithms.whiten([s.token_advantages for s in batch], mean, std)
    return [dataclasses.replace(s, token_advantages=a) for s, a in zip(batch, adv)]


def whitening_moments(sums: Optional[dict[str, float]], all_reduce=None) -> tuple[float, float]:
    """The mean and std the advantages are whitened with, from ``critic_sums`` (None: no
    tokens), added up over the data-parallel ranks by ``all_reduce`` first (see ``whiten_targets``)."""
    moments = [sums["n"], sums["a"], sums["a2"]] if sums is not None else [0.0, 0.0, 0.0]
    if all_reduce is not None:
        t = torch.tensor(moments, dtype=torch.float64)
        all_reduce(t)
        moments = t.tolist()
    return algorithms.whiten_moments(*moments)


def _gathered_state_dict(module: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
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


def _gradients_to_divide(engine) -> Optional[list[torch.Tensor]]:
    """The tensors holding ``engine``'s summed gradients, or None where its optimizer divides
    them itself (a ZeRO 1-3 optimizer with a loss scaler: ``_loss_scale_times``)."""
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
def _loss_scale_times(optimizer, factor: float):
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


class Trainer:
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

    # -- weights -----------------------------------------------------------------
    def state_dict(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """Full tensors, on the CPU, whatever the ZeRO stage: under ZeRO-3 each rank holds
        only its shard (the module's parameters are empty placeholders), so they are
        gathered first, module by module (:func:`_gathered_state_dict`). Every rank must
        call this (the gather is a collective); ``keep`` False: take part, keep nothing
        (the ranks whose copy nobody reads)."""
        module = self.engine.module
        if self.lora is not None:  # what the engines load: the adapter alone (ZeRO-3 is refused with it)
            from workers.train.lora import adapter_state_dict

            return {k: v.detach().to("cpu", self.autocast_dtype if self.autocast_dtype is not None
                                     and v.dtype == torch.float32 else v.dtype)
                    for k, v in adapter_state_dict(module).items()}
        if self.spec.trainer.zero_stage == 3:
            return _gathered_state_dict(module, keep)
        if self.autocast_dtype is not None:
            # fp32 parameters under autocast: what leaves is in model.dtype, as the engines load it
            return {k: v.detach().to("cpu", self.autocast_dtype if v.dtype == torch.float32 else v.dtype)
                    for k, v in module.state_dict().items()}
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}

    def critic_state_dict(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """The critic's full tensors on the CPU, in the dtype it trains in (the critic stage's
        copy computes what this one would). Every rank must call this under ZeRO-3."""
        module = self.critic.engine.module
        if self.spec.critic.zero_stage == 3:
            return _gathered_state_dict(module, keep)
        return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}

    def weight_metadata(self) -> dict[str, str]:
        """The header entries of the weight file ``state_dict`` is written to: with model.lora
        PEFT's adapter_config, which the engines need to serve the adapter."""
        if self.lora is None:
            return {}
        from workers.train.lora import adapter_metadata

        return adapter_metadata(self.engine.module)

    def write_weight_file(self, path: str) -> "WeightFile":
        """The weights the engines load (``state_dict``) as a safetensors file at ``path``,
        with ``weight_metadata`` in its header (files.WeightWriter)."""
        from workers.weights.files import write_weight_file

        return write_weight_file(self.state_dict(), path, self.weight_metadata() or None)

    def save(self, path: str) -> None:
        """A complete HF folder (weights + the tokenizer files) that vLLM can load. With
        model.lora: the base model with the adapter merged in, and the adapter itself as a
        PEFT folder in ``adapter/``."""
        import shutil

        if self.lora is not None:
            from workers.train.lora import merged_state_dict

            module = self.engine.module
            state = merged_state_dict(module)
            if self.autocast_dtype is not None:
                state = {k: v.to(self.autocast_dtype) if v.dtype == torch.float32 else v for k, v in state.items()}
            module.get_base_model().save_pretrained(path, state_dict=state, safe_serialization=True)
            from workers.train.lora import save_adapter

            save_adapter(module, os.path.join(path, "adapter"))
        else:
            state = self.state_dict()
            self.engine.module.save_pretrained(path, state_dict=state, safe_serialization=True)
        if self.autocast_dtype is not None:  # save_pretrained wrote the fp32 module's dtype
            import json

            with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
                cfg = json.load(fh)
            cfg["dtype"] = model_dtype(self.spec)
            with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as fh:
                json.dump(cfg, fh, indent=2, sort_keys=True)
        for name in os.listdir(self.model_path):
            if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template", "added_tokens",
                                "spiece", "sentencepiece")):
                shutil.copy(os.path.join(self.model_path, name), path)

    # -- checkpoints (workers/io/checkpoint.py) ------------------------------------------
    # DeepSpeed's own checkpoint: module, optimiser (whatever wraps it at this ZeRO stage
    # and dtype) and scheduler states, restored exactly by load_state.
    def save_state(self, folder: str) -> None:
        self.engine.save_checkpoint(folder, tag="ds", client_state={"fluxrl_version": self.version},
                                    save_latest=False)
        if self.critic is not None:
            self.critic.save_state(folder)

    def load_state(self, folder: str) -> int:
        """Restore a save_state folder; returns (and takes) the policy version saved."""
        path, client = self.engine.load_checkpoint(folder, tag="ds", load_optimizer_states=True,
                                                   load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {folder}")
        self.version = int(client["fluxrl_version"])
        if self.critic is not None:
            self.critic.load_state(folder)
        return self.version

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
        optimizer class DeepSpeed uses (see ``_gradients_to_divide``), the policy's (by
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
          (``_loss_scale_times``: the dynamic fp16 scaler is left as a whole-batch step leaves it)."""
        parts = [(self.engine, lambda: self.engine.backward(self._idle_pass(self.engine)), denominator * policy_scale)]
        if self.critic is not None:
            parts.append((self.critic.engine, lambda: self.critic.idle_pass(*self._idle_ids(), boundary=True),
                          denominator))
        for engine, idle_pass, divisor in parts:
            engine.set_gradient_accumulation_boundary(True)
            gradients = _gradients_to_divide(engine)
            if gradients is None:  # a ZeRO optimizer that unscales in its step
                idle_pass()
                steps.enter_context(_loss_scale_times(engine.optimizer, float(divisor)))
                continue
            with torch.no_grad():
                for grad in gradients:
                    grad.div_(divisor)
            if torch.distributed.get_world_size() > 1:
                engine.allreduce_gradients()

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
