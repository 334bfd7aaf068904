"""The ``algorithm`` section: the loss, the advantages, the KL penalty and the optimiser."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from workers.spec.base import MAX_GROUP_SIZE, _Strict

# algorithm.minibatches for loss ppo when the spec leaves it out: measured on the demo by
# bench/minibatches.py (docs/engine.md, "Trainer": why 2).
DEFAULT_PPO_MINIBATCHES = 2


class AlgorithmSpec(_Strict):
    loss: Literal["ppo", "reinforce"] = "ppo"
    group_size: int = Field(8, ge=1, le=MAX_GROUP_SIZE, description="samples per prompt, generated side by side: "
                            "at most 1024, and with rollout.share_engines at most rollout.max_num_seqs (the pool's "
                            "seats)")
    lr: float = Field(5e-5, gt=0)
    warmup_steps: int = Field(10, ge=0, description="linear learning-rate warm-up: Adam's first steps "
                              "are sign-like and move every weight by the full lr, a jolt that costs reward")
    lr_decay: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="after the warm-up: keep the lr, or decay it to lr_floor x lr at stop.max_steps")
    lr_floor: float = Field(0.0, ge=0, le=1, description="the decayed lr's last value, as a share of lr")
    clip: float = Field(0.2, gt=0)
    kl_coef: float = Field(0.0, ge=0)
    kl_penalty: Literal["loss", "reward"] = Field(
        "loss", description="where the KL to the reference goes (kl_coef > 0): loss = a penalty term added to the "
        "policy loss (kl_estimator); reward = InstructGPT's per-token reward −kl_coef·(log π_old − log π_ref), "
        "π_old the behaviour policy that sampled the token, added to the sequence's reward (on its last token) "
        "before GAE, so the critic learns it and the loss has no KL term. reward needs advantage gae")
    kl_estimator: Literal["k2", "k3"] = Field("k2", description="the KL(π‖π_ref) penalty's per-token form "
                                              "(kl_coef > 0): k2 = ½(log π − log π_ref)², whose gradient is "
                                              "that of KL(π‖π_ref); k3 = GRPO's estimator, whose gradient as a "
                                              "loss is that of the reverse KL(π_ref‖π). Stale tokens are "
                                              "importance-weighted as in the policy loss")
    kl_reference: Literal["trainer", "stage"] = Field(
        "trainer", description="where the KL reference's forward runs (kl_coef > 0): inside the trainer's step, or "
        "in the inference stage, a worker process of its own that takes each sample as it finishes generating, in "
        "micro-batches (inference.*), so the trainer holds one model less and its step one forward less")
    behav_weight_cap: float = Field(5.0, gt=0, description="correction none: ppo drops (weight 0) the tokens "
                                    "whose π_prox/π_behav passes it (AReaL); reinforce truncates π/π_behav at it")
    correction: Literal["none", "tis", "mis"] = Field(
        "none", description="how the importance ratio ρ = π_prox/π_behav between the trainer and the engine "
        "(reinforce: π_θ/π_behav) is bounded before it weights each token's loss: none = the loss's own rule "
        "(behav_weight_cap); tis = truncated, min(ρ, correction_cap); mis = masked, ρ inside [1/correction_cap, "
        "correction_cap] and 0 outside. ρ is already the whole trainer/engine ratio (at staleness 0 the "
        "mismatch alone, for a stale token times the policy's drift since), so tis and mis replace "
        "behav_weight_cap's rule rather than multiply a second weight on top (docs/engine.md)")
    correction_level: Literal["token", "sequence"] = Field(
        "token", description="correction tis/mis: token = each token's own ratio; sequence = the sequence's "
        "ratio exp(Σ log ρ_t), truncated or masked as a whole, on every one of its tokens")
    correction_cap: float = Field(2.0, gt=1, description="correction tis/mis: the truncation cap, and the band "
                                  "[1/cap, cap] outside which mis masks")
    normalize: Literal["tokens", "batch"] = "tokens"
    adv_std_norm: bool = False
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    minibatches: Optional[int] = Field(
        None, ge=1, le=1024, description="optimiser steps per batch (its samples split evenly); π_prox of "
        "decoupled PPO stays fixed at the start of the batch. Left out: 2 for loss ppo, so that its clip can bind "
        "(with one step π_prox is the policy being differentiated, and ppo is REINFORCE with a behaviour "
        "weight), 1 for reinforce and with schedule.stream_train (bench/minibatches.py). Two steps move the "
        "policy about twice as far per batch as one: at lr 5e-5 they learned as fast or faster on every model "
        "tried, and two steps at half the lr matched one step (bench/defaults.py); a run that peaks and falls "
        "back wants fewer steps or a lower lr")
    ppo_epochs: int = Field(1, ge=1, le=64, description="passes over each batch, each split into minibatches")
    drop_uniform_groups: bool = Field(False, description="async: skip prompt groups whose rewards are all equal "
                                      "(zero advantages) and fill the batch with others (DAPO's dynamic sampling)")
    advantage: Literal["group", "gae"] = Field(
        "group", description="group: GRPO's reward minus its prompt group's mean; gae: a critic (a value model "
        "trained beside the policy, see critic) and GAE(gamma, lam) per token, as PPO-RLHF does")
    gamma: float = Field(1.0, ge=0, le=1, description="gae: the discount per token")
    lam: float = Field(0.95, ge=0, le=1, description="gae: the bias/variance trade-off of GAE (1 = Monte Carlo "
                       "returns minus the value, 0 = one-step TD)")
    whiten_advantages: bool = Field(
        True, description="gae: whiten the per-token advantages, (A − mean) / (std + 1e-8), the mean and the "
        "(population) std over all the generated tokens of the step's batch, across data-parallel ranks, as verl, "
        "OpenRLHF and TRL do (a critic that starts at 0 and rewards in [0, 1] otherwise make every early "
        "advantage >= 0); the critic's returns stay raw. With schedule.stream_train the same whole-batch "
        "whitening is applied to the step's gradients at its end (needs trainer.zero_stage 0, not float16). "
        "advantage group ignores it (GRPO centres each prompt group already; adv_std_norm "
        "scales it)")

    @model_validator(mode="after")
    def _kl_in_the_reward_needs_gae(self):
        if self.kl_penalty == "reward" and self.advantage != "gae":
            raise ValueError("algorithm.kl_penalty 'reward' adds the KL to the per-token rewards of GAE: it needs "
                             "algorithm.advantage 'gae' (group advantages have one reward per sequence)")
        return self
