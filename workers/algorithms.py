"""The RL maths, free of engines: group advantages, the two policy losses, the KL
penalty and token-budget packing. Pure functions with exact unit tests.

Conventions: per-token tensors are [batch, seq] with a float ``mask`` (1 = a generated
token that is trained on). ``denominator`` is chosen once per optimiser step (not per
micro-batch), so the loss of a packed step equals the loss of the unpacked batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


def lr_factor(step: int, warmup: int, decay: str = "constant", total: int = 0, floor: float = 0.0) -> float:
    """The learning-rate multiplier at optimiser step ``step`` (0-based).

    Linear warm-up over ``warmup`` steps, then ``constant``, or a ``linear`` / ``cosine``
    decay that reaches ``floor`` at step ``total``. A decaying lr lets a policy that has
    found its answers keep them: at a constant lr the late updates keep moving greedy
    outputs, and held-out accuracy drifts down again.
    """
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if decay == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if decay == "linear":
        shape = 1.0 - progress
    elif decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown lr decay {decay!r}")
    return floor + (1.0 - floor) * shape


def group_advantages(rewards: Sequence[float], group_size: int, std_norm: bool = False, eps: float = 1e-6) -> list[float]:
    """GRPO: advantage = reward − mean of its group (÷ group std when ``std_norm``).

    ``rewards`` holds consecutive groups of ``group_size`` completions of one prompt.
    """
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    out: list[float] = []
    for g in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[g : g + group_size]]
        mean = sum(group) / len(group)
        std = (sum((r - mean) ** 2 for r in group) / len(group)) ** 0.5
        out.extend((r - mean) / (std + eps) if std_norm else r - mean for r in group)
    return out


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar to backpropagate (already divided by the step's denominator)
    clip_frac: float  # share of trained tokens whose ratio was clipped
    behav_weight_mean: float  # mean importance weight proximal/behaviour (ppo) or current/behaviour (reinforce)
    tokens: int


def normalizer(mask: torch.Tensor, how: str) -> float:
    """Denominator for one optimiser step: trained tokens ("tokens") or sequences ("batch")."""
    if how == "tokens":
        return float(mask.sum().clamp(min=1))
    if how == "batch":
        return float(max(1, int((mask.sum(-1) > 0).sum())))
    raise ValueError(f"unknown normalisation {how!r}")


def ppo_decoupled_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    behav_weight_cap: float,
    denominator: float,
) -> LossOutput:
    """AReaL's decoupled PPO: clip the current/proximal ratio, weight each token by the
    proximal/behaviour ratio (clamped at ``behav_weight_cap``) so off-policy tokens from
    stale policy versions are corrected without letting them dominate.

    ``advantages`` is per sequence [batch] or per token [batch, seq].
    """
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    ratio = torch.exp(logp - logp_prox.detach())
    clipped = torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    behav_w = torch.exp(logp_prox - logp_behav).detach().clamp(max=behav_weight_cap)
    per_token = -behav_w * surrogate * mask
    n = float(mask.sum())
    with torch.no_grad():
        was_clipped = ((ratio * adv) > (clipped * adv)).float() * mask
    return LossOutput(
        loss=per_token.sum() / denominator,
        clip_frac=float(was_clipped.sum()) / max(n, 1.0),
        behav_weight_mean=float((behav_w * mask).sum()) / max(n, 1.0),
        tokens=int(n),
    )


def reinforce_tis_loss(
    logp: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weight_cap: float,
    denominator: float,
) -> LossOutput:
    """PipelineRL-style REINFORCE with truncated importance sampling:
    −min(π/μ, cap)·A·log π per token, the weight treated as a constant."""
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    raw_w = torch.exp(logp - logp_behav).detach()
    weight = raw_w.clamp(max=weight_cap)
    per_token = -weight * adv * logp * mask
    n = float(mask.sum())
    return LossOutput(
        loss=per_token.sum() / denominator,
        clip_frac=float(((raw_w > weight_cap).float() * mask).sum()) / max(n, 1.0),
        behav_weight_mean=float((weight * mask).sum()) / max(n, 1.0),
        tokens=int(n),
    )


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, denominator: float) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π‖π_ref): exp(r) − r − 1 with r = log π_ref − log π (≥ 0)."""
    r = logp_ref.detach() - logp
    return ((torch.exp(r) - r - 1.0) * mask).sum() / denominator


def pack_first_fit_decreasing(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Pack sequences into micro-batches whose *padded* size (rows × longest row) stays
    within ``token_budget``, so the budget bounds real compute and memory.

    First-fit-decreasing: longest first, each into the first micro-batch it fits; a
    sequence longer than the budget gets a micro-batch of its own. Returns lists of
    indices into ``lengths``: bins in creation order, inside a bin decreasing length
    (ties by index), so a bin's first entry is its longest.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    for i in order:
        for b in bins:
            if (len(b) + 1) * lengths[b[0]] <= token_budget:
                b.append(i)
                break
        else:
            bins.append([i])
    return bins
