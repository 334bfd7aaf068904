"""TrainSample, one trained sequence, and the pure functions the trainers compute on a batch
of them: step denominators, minibatch parts, GAE's critic targets and advantage whitening.
Shared by the single-process trainer (workers/train/trainer.py), the data-parallel ranks
(workers/train/ranks.py) and the pipeline trainer (workers/train/pipeline_trainer.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from workers.train import algorithms

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

