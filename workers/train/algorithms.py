"""The RL maths, free of engines: group advantages, the two policy losses, the KL
penalty, the sampler's truncation and token-budget packing. Pure functions with exact unit tests.

Conventions: per-token tensors are [batch, seq] with a float ``mask`` (1 = a generated
token that is trained on). ``denominator`` is chosen once per optimiser step (not per
micro-batch), so the loss of a packed step equals the loss of the unpacked batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

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


def gae(rewards: Sequence[float], values: Sequence[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """Generalized advantage estimation (Schulman et al. 2016) over one completion.

    ``rewards[t]`` and ``values[t]`` belong to generated token t (the value is the critic's
    estimate of the state *before* token t is emitted); the episode ends after the last
    token, so the value after it is 0. δ_t = r_t + γ·V_{t+1} − V_t and
    A_t = Σ_l (γλ)^l δ_{t+l}; the critic's target is the return A_t + V_t (λ-return).
    Returns (advantages, returns), one per token.
    """
    if len(rewards) != len(values):
        raise ValueError(f"{len(rewards)} rewards but {len(values)} values")
    adv = [0.0] * len(rewards)
    running, next_value = 0.0, 0.0
    for t in range(len(rewards) - 1, -1, -1):
        delta = float(rewards[t]) + gamma * next_value - float(values[t])
        running = delta + gamma * lam * running
        adv[t] = running
        next_value = float(values[t])
    return adv, [a + float(v) for a, v in zip(adv, values)]


def terminal_rewards(reward: float, tokens: int) -> list[float]:
    """A sequence-level reward as per-token rewards: all of it on the last token (the
    outcome is known only when the completion ends), 0 before."""
    return [0.0] * (tokens - 1) + [float(reward)] if tokens > 0 else []


def kl_rewards(reward: float, logp_old: Sequence[float], logp_ref: Sequence[float], kl_coef: float) -> list[float]:
    """Per-token rewards with the KL to the reference in them (InstructGPT; OpenRLHF's PPO):
    r_t = −kl_coef·(log π_old(y_t) − log π_ref(y_t)), the sequence's ``reward`` added on the
    last token. π_old is the policy that sampled the tokens, so the sum over the completion
    is an estimate of −kl_coef·KL(π_old‖π_ref) (the k1 estimator), which GAE then credits
    token by token."""
    if len(logp_old) != len(logp_ref):
        raise ValueError(f"{len(logp_old)} log-probs but {len(logp_ref)} reference log-probs")
    out = [-kl_coef * (float(o) - float(r)) for o, r in zip(logp_old, logp_ref)]
    if out:
        out[-1] += float(reward)
    return out


WHITEN_EPS = 1e-8


def whiten_moments(n: float, total: float, total_sq: float) -> tuple[float, float]:
    """The mean and the population standard deviation of values from their count, sum and
    sum of squares (sums, so data-parallel ranks can add theirs up first); (0, 0) for none."""
    if n <= 0:
        return 0.0, 0.0
    mean = total / n
    return mean, max(total_sq / n - mean * mean, 0.0) ** 0.5


def whiten(advantages: Sequence[Sequence[float]], mean: float, std: float,
           eps: float = WHITEN_EPS) -> list[list[float]]:
    """Each sequence's per-token advantages whitened, (A − mean) / (std + eps), with the
    ``mean`` and ``std`` of all the tokens they are whitened over (``whiten_moments``: of a
    whole batch, not each sequence's own). Sequences are ragged lists of their generated
    tokens only, so padding never enters the statistics."""
    return [[(float(a) - mean) / (std + eps) for a in seq] for seq in advantages]


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float, denominator: float) -> tuple[torch.Tensor, float]:
    """PPO's clipped value loss: ½·max((V − R)², (V_clip − R)²) per token, where V_clip stays
    within ``clip`` of the values the targets were computed with (``old_values``), so one
    batch cannot drag the critic far from where its advantages came from. Returns the loss
    (summed over ``mask`` ÷ ``denominator``) and the share of tokens whose clipped term won."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_err = (values - returns) ** 2
    clipped_err = (clipped - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped_err, clipped_err) * mask
    n = float(mask.sum())
    with torch.no_grad():
        clip_frac = float(((clipped_err > unclipped_err).float() * mask).sum()) / max(n, 1.0)
    return per_token.sum() / denominator, clip_frac


CRITIC_SUM_KEYS = ("n", "v", "r", "r2", "d", "d2", "a", "a2", "kl_n", "kl")


def critic_sums(values: Sequence[Sequence[float]], returns: Sequence[Sequence[float]],
                advantages: Sequence[Sequence[float]],
                kl: Optional[Sequence[Sequence[float]]] = None) -> dict[str, float]:
    """Per-token sums (count; values; returns and their squares; returns − values and their
    squares; advantages and their squares; with ``kl``, the per-token log π_old − log π_ref
    the rewards were charged and their count) from which ``critic_stats`` follow: sums, so
    data-parallel ranks can add theirs up."""
    flat = [(v, r, a) for vs, rs, As in zip(values, returns, advantages) for v, r, a in zip(vs, rs, As)]
    kl_flat = [k for seq in kl for k in seq] if kl is not None else []
    return {"n": float(len(flat)), "v": sum(v for v, _, _ in flat), "r": sum(r for _, r, _ in flat),
            "r2": sum(r * r for _, r, _ in flat), "d": sum(r - v for v, r, _ in flat),
            "d2": sum((r - v) ** 2 for v, r, _ in flat), "a": sum(a for _, _, a in flat),
            "a2": sum(a * a for _, _, a in flat), "kl_n": float(len(kl_flat)), "kl": sum(kl_flat)}


def critic_stats(sums: dict[str, float]) -> dict[str, float]:
    """The critic's metrics from ``critic_sums``: explained variance 1 − Var(R − V)/Var(R)
    (0 when the returns are constant), and the means of values, returns and advantages and
    the advantages' standard deviation."""
    n = max(sums["n"], 1.0)
    var_r = sums["r2"] / n - (sums["r"] / n) ** 2
    var_d = sums["d2"] / n - (sums["d"] / n) ** 2
    adv_mean = sums["a"] / n
    stats = {
        "critic/explained_var": 1.0 - var_d / var_r if var_r > 1e-12 else 0.0,
        "critic/value_mean": sums["v"] / n,
        "critic/return_mean": sums["r"] / n,
        "critic/adv_mean": adv_mean,
        "critic/adv_std": max(sums["a2"] / n - adv_mean ** 2, 0.0) ** 0.5,
    }
    if sums.get("kl_n", 0.0) > 0:  # algorithm.kl_penalty 'reward': the KL the rewards paid, per token
        stats["reward/kl"] = sums["kl"] / sums["kl_n"]
    return stats


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar to backpropagate (already divided by the step's denominator)
    clip_frac: float  # share of trained tokens whose ratio was clipped
    behav_weight_mean: float  # mean importance weight proximal/behaviour (ppo) or current/behaviour (reinforce)
    tokens: int  # tokens in the mask
    weights: torch.Tensor  # the per-token importance weight used (detached; 0 where a token was dropped)
    dropped: int = 0  # tokens whose behaviour weight the cap or the correction's band set to 0
    truncated: int = 0  # tokens whose behaviour weight was cut down to the cap (reinforce, correction tis)


CORRECTIONS = ("none", "tis", "mis")
CORRECTION_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class Correction:
    """``algorithm.correction``: how the trainer/engine importance ratio ρ = π_prox/π_behav
    (reinforce: π_θ/π_behav, detached) is bounded before it weights the loss.

    ``level`` picks the ratio: ``token``, each token's own ρ_t; ``sequence``, the
    sequence's ρ = exp(Σ_t log ρ_t) on every one of its tokens. ``method`` picks the rule:
    ``tis`` truncates, w = min(ρ, cap); ``mis`` masks, w = ρ inside [1/cap, cap] and 0
    outside. ``none`` keeps the loss's own rule (ppo: drop above ``behav_weight_cap``;
    reinforce: truncate at it)."""
    method: str = "none"
    level: str = "token"
    cap: float = 2.0

    def __post_init__(self):
        if self.method not in CORRECTIONS:
            raise ValueError(f"unknown correction {self.method!r}; choose one of {', '.join(CORRECTIONS)}")
        if self.level not in CORRECTION_LEVELS:
            raise ValueError(f"unknown correction level {self.level!r}; choose one of {', '.join(CORRECTION_LEVELS)}")
        if self.method != "none" and not self.cap > 1.0:
            raise ValueError(f"a correction's cap must be > 1, not {self.cap}")

    @classmethod
    def of(cls, algo) -> "Correction":
        return cls(getattr(algo, "correction", "none"), getattr(algo, "correction_level", "token"),
                   getattr(algo, "correction_cap", 2.0))


def corrected_weights(log_ratio: torch.Tensor, mask: torch.Tensor, correction: Correction
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The importance weights ``correction`` gives tokens whose log-ratio log π_prox − log π_behav
    is ``log_ratio`` [batch, seq] (only ``mask``'s tokens count, in a sequence's sum too).

    Returns (weights, dropped, truncated): the detached per-token weight (0 off the mask), and
    per token whether the rule set it to 0 (mis) or cut it down to the cap (tis)."""
    lr = log_ratio.detach().float() * mask
    if correction.level == "sequence":
        lr = lr.sum(-1, keepdim=True).expand_as(mask)
    # exp of a sequence's summed log-ratio overflows long before the comparison matters: clamp
    # to where the cap decides anyway (log 1e30 ≫ log cap)
    ratio = torch.exp(lr.clamp(-69.0, 69.0))
    on = mask > 0
    if correction.method == "tis":
        truncated = (ratio > correction.cap) & on
        return ratio.clamp(max=correction.cap) * mask, torch.zeros_like(on), truncated
    if correction.method == "mis":
        outside = ((ratio > correction.cap) | (ratio < 1.0 / correction.cap)) & on
        return ratio * mask * (~outside).float(), outside, torch.zeros_like(on)
    raise ValueError("correction none has no weights of its own: the loss's behav_weight_cap rule applies")


def normalizer(mask: torch.Tensor, how: str) -> float:
    """Denominator for one optimiser step, i.e. how the per-token losses are aggregated:
    "tokens": the token mean over the whole step (DAPO's token-level aggregation: a long
    completion weighs by its length); "batch": the sum over a sequence's tokens, averaged
    over sequences (each completion weighs the same per token it has, Dr. GRPO-style
    constant normaliser). Chosen once per step, so packing and minibatches leave it alone."""
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
    correction: Optional[Correction] = None,
) -> LossOutput:
    """AReaL's decoupled PPO: clip the current/proximal ratio, weight each token by the
    proximal/behaviour ratio, and leave out (weight 0) the tokens whose proximal/behaviour
    ratio passes ``behav_weight_cap``: a token that stale a policy would rarely have
    sampled is dropped, as AReaL does, not kept at the cap.

    π_prox/π_behav is already the whole importance ratio between the trainer and the engine
    (policy drift since the token's version times the trainer/engine mismatch), so a
    ``correction`` (tis or mis) *replaces* that cap rule: multiplying it on top would weight
    each token by the ratio twice.

    ``advantages`` is per sequence [batch] or per token [batch, seq].
    """
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    ratio = torch.exp(logp - logp_prox.detach())
    clipped = torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    truncated = 0
    if correction is not None and correction.method != "none":
        behav_w, dropped_t, truncated_t = corrected_weights(logp_prox - logp_behav, mask, correction)
        kept = mask * (~dropped_t).float()
        truncated = int(truncated_t.sum())
    else:
        raw_w = torch.exp(logp_prox - logp_behav).detach()
        kept = (raw_w <= behav_weight_cap).float() * mask
        behav_w = raw_w * kept
    per_token = -behav_w * surrogate
    n = float(mask.sum())
    with torch.no_grad():
        was_clipped = ((ratio * adv) > (clipped * adv)).float() * kept
        trained = float(kept.sum())
    return LossOutput(
        loss=per_token.sum() / denominator,
        clip_frac=float(was_clipped.sum()) / max(n, 1.0),
        behav_weight_mean=float(behav_w.sum()) / max(trained, 1.0),
        tokens=int(n),
        weights=behav_w,
        dropped=int(n - trained),
        truncated=truncated,
    )


def reinforce_tis_loss(
    logp: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weight_cap: float,
    denominator: float,
    correction: Optional[Correction] = None,
) -> LossOutput:
    """PipelineRL-style REINFORCE with truncated importance sampling:
    −min(π/μ, cap)·A·log π per token, the weight treated as a constant (truncated, not
    dropped: that is what makes it TIS). A ``correction`` (tis or mis) bounds the same
    ratio π/μ its own way instead (token-level tis at cap c is this loss at weight_cap c)."""
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    n = float(mask.sum())
    if correction is not None and correction.method != "none":
        weight, dropped_t, truncated_t = corrected_weights(logp - logp_behav, mask, correction)
        dropped, truncated = int(dropped_t.sum()), int(truncated_t.sum())
    else:
        raw_w = torch.exp(logp - logp_behav).detach()
        weight = raw_w.clamp(max=weight_cap) * mask
        dropped, truncated = 0, int(((raw_w > weight_cap).float() * mask).sum())
    per_token = -weight * adv * logp * mask
    return LossOutput(
        loss=per_token.sum() / denominator,
        clip_frac=truncated / max(n, 1.0),
        behav_weight_mean=float(weight.sum()) / max(n - dropped, 1.0),
        tokens=int(n),
        weights=weight,
        dropped=dropped,
        truncated=truncated,
    )


# -- the trainer/engine mismatch, as metrics ------------------------------------------------
# Each trained token's log-ratio r = log π_prox − log π_behav: at staleness 0 π_prox is the
# very version that sampled the token, so r is the mismatch between the trainer's numerics
# and the engine's alone; a stale token's r adds the policy's drift since its version. Kept
# as sums (additive over micro-batches, minibatch steps and data-parallel ranks) and maxima.
STALENESS_BUCKETS = ("0", "1", "2", "3plus")  # a token's staleness: current version − its version
RATIO_EDGES = (0.5, 0.8, 0.95, 1.05, 1.25, 2.0)  # inner edges of mismatch/ratio_hist's bins
RATIO_BINS = ("0",) + tuple(f"{e:g}" for e in RATIO_EDGES)  # each bin named by its lower edge
QUANTILE_STEP = 0.01  # the quantiles' resolution in log-ratio (a ratio to within ±0.5%)
QUANTILE_HALF = 400  # bins each side of 0: ratios e^±4 and beyond land in the end bins
_GROUPS = 1 + len(STALENESS_BUCKETS)  # all tokens, then each staleness bucket: [n, Σ k3, Σ |r|] each
_HIST_AT = 3 * _GROUPS
_FINE_AT = _HIST_AT + len(RATIO_BINS)
MISMATCH_SUMS = _FINE_AT + 2 * QUANTILE_HALF + 1


@dataclass
class MismatchSums:
    """What the mismatch metrics are computed from: ``sums`` (float64 [MISMATCH_SUMS]: per
    group the token count, Σ k3 and Σ |r|; the coarse ratio histogram; the fine log-ratio
    histogram the quantiles come from) and ``maxima`` (float64 [_GROUPS]: max |r| per group,
    -1 for none), so ranks add the one and take the maximum of the other."""
    sums: torch.Tensor
    maxima: torch.Tensor

    @classmethod
    def zeros(cls) -> "MismatchSums":
        return cls(torch.zeros(MISMATCH_SUMS, dtype=torch.float64), torch.full((_GROUPS,), -1.0, dtype=torch.float64))

    def add(self, other: "MismatchSums") -> "MismatchSums":
        return MismatchSums(self.sums + other.sums, torch.maximum(self.maxima, other.maxima))

    @property
    def tokens(self) -> int:
        return int(self.sums[0])

    def stats(self) -> dict[str, float]:
        """The ``mismatch/*`` metrics (none when no token was seen)."""
        s, m = self.sums.tolist(), self.maxima.tolist()
        n = s[0]
        if n <= 0:
            return {}
        out = {"mismatch/kl": s[1] / n, "mismatch/abs_logp_mean": s[2] / n, "mismatch/abs_logp_max": m[0]}
        for g, name in enumerate(STALENESS_BUCKETS, start=1):
            ng = s[3 * g]
            if ng > 0:
                out[f"mismatch/kl_stale{name}"] = s[3 * g + 1] / ng
                out[f"mismatch/abs_logp_max_stale{name}"] = m[g]
        for name, count in zip(RATIO_BINS, s[_HIST_AT:_FINE_AT]):
            out[f"mismatch/ratio_hist/{name}"] = count / n
        fine = s[_FINE_AT:]
        for label, q in (("p1", 0.01), ("p50", 0.5), ("p99", 0.99)):
            want, seen = max(1.0, math.ceil(q * n)), 0.0
            for k, count in enumerate(fine):
                seen += count
                if seen >= want:
                    break
            out[f"mismatch/ratio_{label}"] = math.exp((k - QUANTILE_HALF) * QUANTILE_STEP)
        return out


def mismatch_sums(log_ratio: torch.Tensor, mask: torch.Tensor, staleness: Optional[torch.Tensor] = None
                  ) -> MismatchSums:
    """The ``MismatchSums`` of the ``mask``'s tokens, their log π_prox − log π_behav
    ``log_ratio`` and ``staleness`` [batch, seq] (a negative staleness, or none given: the
    token counts in the totals only)."""
    on = mask.detach().cpu() > 0
    r = log_ratio.detach().cpu().to(torch.float64)[on]
    stale = (staleness.detach().cpu().to(torch.long)[on] if staleness is not None
             else torch.full_like(r, -1, dtype=torch.long))
    out = MismatchSums.zeros()
    if r.numel() == 0:
        return out
    k3 = torch.expm1(r) - r  # exp(r) − 1 − r ≥ 0: an unbiased estimate of KL(π_behav‖π_prox)
    a = r.abs()
    bucket = stale.clamp(max=len(STALENESS_BUCKETS) - 1)
    for g in range(_GROUPS):
        sel = torch.ones_like(a, dtype=torch.bool) if g == 0 else bucket == g - 1
        if g and not bool(sel.any()):
            continue
        out.sums[3 * g: 3 * g + 3] = torch.stack([sel.sum().to(torch.float64), k3[sel].sum(), a[sel].sum()])
        out.maxima[g] = a[sel].max()
    edges = torch.tensor(RATIO_EDGES, dtype=torch.float64)
    out.sums[_HIST_AT:_FINE_AT] = torch.bincount(torch.bucketize(r.exp(), edges, right=True),
                                                 minlength=len(RATIO_BINS)).to(torch.float64)
    fine = (r / QUANTILE_STEP).round().clamp(-QUANTILE_HALF, QUANTILE_HALF).to(torch.long) + QUANTILE_HALF
    out.sums[_FINE_AT:] = torch.bincount(fine, minlength=2 * QUANTILE_HALF + 1).to(torch.float64)
    return out


def mismatch_stats(sums: MismatchSums, tokens: float, dropped: float, truncated: float) -> dict[str, float]:
    """The step's ``mismatch/*`` metrics: ``sums``' and the shares of its ``tokens`` that the
    cap or the correction dropped (weight 0) and truncated (weight cut to the cap)."""
    out = sums.stats()
    if tokens > 0:
        out["mismatch/dropped_share"] = dropped / tokens
        out["mismatch/truncated_share"] = truncated / tokens
    return out


KL_ESTIMATORS = ("k2", "k3")


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, denominator: float,
               estimator: str = "k2", weights: torch.Tensor | None = None) -> torch.Tensor:
    """A KL penalty between the policy π and the reference π_ref, per sampled token, as a loss.

    With r = log π − log π_ref at a token drawn from π:

    - ``k2`` = ½·r². Its gradient is r·∇log π, whose expectation over tokens from π is
      ∇KL(π‖π_ref): the penalty the name promises.
    - ``k3`` = exp(−r) + r − 1 (Schulman's low-variance estimator, GRPO's choice). An
      unbiased estimate of the *value* of KL(π‖π_ref), but as a loss its gradient,
      (1 − π_ref/π)·∇log π, has the expectation −E_{π_ref}[∇log π] = ∇KL(π_ref‖π): the
      reverse KL. Kept for comparison with GRPO.

    Tokens come from the behaviour policy μ, not π, when samples are stale: ``weights``
    (detached π/μ or π_prox/μ, as the policy loss uses them, 0 for a dropped token)
    reweight them to expectations under π. Without ``weights`` every masked token
    counts 1.
    """
    r = logp - logp_ref.detach()
    if estimator == "k2":
        per_token = 0.5 * r * r
    elif estimator == "k3":
        per_token = torch.exp(-r) + r - 1.0
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")
    w = mask if weights is None else weights.detach() * mask
    return (per_token * w).sum() / denominator


def truncated_logits(logits: torch.Tensor, top_k: int = -1, top_p: float = 1.0,
                     keep: torch.Tensor | None = None) -> torch.Tensor:
    """The logits with vLLM's top-k, then top-p, truncation applied over the last
    dimension (masked entries −inf), so that log-softmax of the result is the sampler's
    "processed" log-prob: the distribution the tokens were really drawn from.

    - top-k keeps every logit at least the k-th largest (ties kept);
    - top-p then sorts what is left in ascending order and masks the entries whose
      cumulative probability, counted from the smallest, is at most 1 − p; the largest
      always stays.

    ``keep`` (token ids, shaped like ``logits`` without its last dimension) are never
    masked: a sampled token must keep a finite log-prob even where the trainer's
    arithmetic puts it a hair outside the kept set that the engine's put it in.
    """
    if top_k is not None and 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        drop = logits < kth
    else:
        drop = torch.zeros_like(logits, dtype=torch.bool)
    if top_p is not None and top_p < 1.0:
        masked = logits.masked_fill(drop, float("-inf"))
        ordered, order = masked.sort(dim=-1, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1.0 - top_p
        drop_sorted[..., -1] = False
        drop = drop | torch.zeros_like(drop).scatter(-1, order, drop_sorted)
    if keep is not None:
        drop = drop.scatter(-1, keep.unsqueeze(-1), False)
    return logits.masked_fill(drop, float("-inf"))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, top_k: int = -1, top_p: float = 1.0,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` [batch, seq] under ``logits`` [batch, seq, vocab] (already
    divided by the temperature), truncated as the engine sampled (see truncated_logits),
    and the per-position entropy of that distribution when asked."""
    if (top_k is not None and top_k > 0) or (top_p is not None and top_p < 1.0):
        logits = truncated_logits(logits, top_k, top_p, keep=targets)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = torch.special.entr(logp_all.exp()).sum(-1) if with_entropy else None
    return logp, entropy


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
