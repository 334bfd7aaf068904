"""algorithm.whiten_advantages (GAE's advantages whitened over the batch's tokens, on by
default) and algorithm.kl_penalty 'reward' (the KL to the reference in GAE's per-token
rewards): exact numbers on hand-computed batches, the maths alone and inside the tiny
model's DeepSpeed trainer."""
import dataclasses

import pytest
import torch

from workers.spec import SpecError, validate_spec
from workers.train.algorithms import gae, kl_rewards, whiten, whiten_moments
from workers.train.batching import completion_mask, per_token
from workers.train.pipeline import Hyper
from workers.train.samples import TrainSample, whiten_targets, with_critic_targets

EPS = 1e-8


def _algo(**algorithm):
    return validate_spec({"name": "w", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
                          "algorithm": {"advantage": "gae", **algorithm}}).algorithm


def _flat(nested):
    return [x for seq in nested for x in seq]


def _sums(advantages):
    flat = [a for seq in advantages for a in seq]
    return {"n": float(len(flat)), "a": sum(flat), "a2": sum(a * a for a in flat)}


def test_the_whitening_is_on_by_default_and_the_kl_stays_in_the_loss():
    algo = validate_spec({"name": "w", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"}}).algorithm
    assert algo.whiten_advantages is True and algo.kl_penalty == "loss"
    assert _algo().whiten_advantages is True


def test_a_known_batch_is_whitened_over_all_its_tokens_not_per_sequence():
    # tokens 0, 4, 4 | 0: mean 2, population variance (4 + 4 + 4 + 4) / 4 = 4, std 2
    adv = [[0.0, 4.0, 4.0], [0.0]]
    assert whiten_moments(4, 8.0, 32.0) == (2.0, 2.0)
    got = whiten(adv, 2.0, 2.0)
    want = [[-2 / (2 + EPS), 2 / (2 + EPS), 2 / (2 + EPS)], [-2 / (2 + EPS)]]
    assert _flat(got) == pytest.approx(_flat(want), abs=1e-15) and [len(g) for g in got] == [3, 1]
    # per sequence the one-token sequence would have been 0: the batch's statistics decide
    assert got[1][0] == pytest.approx(-1.0, abs=1e-8)
    assert whiten_moments(0, 0.0, 0.0) == (0.0, 0.0)
    assert whiten([[3.0, 3.0]], 3.0, 0.0) == [[0.0, 0.0]]  # equal advantages: all 0, no division by 0


def test_padding_never_enters_the_statistics_and_stays_zero_in_the_mask_layout():
    # three completions of 1, 3 and 2 tokens behind prompts of 3, 1 and 2 tokens: 4 columns each
    pairs = [([1, 2, 3], [7]), ([1], [7, 8, 9]), ([1, 2], [7, 8])]
    adv = [[1.0], [2.0, 3.0, 4.0], [5.0, 6.0]]
    mean, std = whiten_moments(**dict(zip(("n", "total", "total_sq"), _sums(adv).values())))
    assert (mean, std) == pytest.approx((3.5, (35 / 12) ** 0.5), abs=1e-12)  # over the 6 tokens alone
    laid = per_token(pairs, 4, whiten(adv, mean, std))
    mask = completion_mask(pairs, 4)
    assert int(mask.sum()) == 6
    assert laid[mask == 0].abs().max().item() == 0.0  # padding (and prompt) columns untouched
    kept = laid[mask == 1].double()
    assert kept.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert kept.var(unbiased=False).sqrt().item() == pytest.approx(1.0, abs=1e-6)
    assert laid[0, 2].item() == pytest.approx((1.0 - 3.5) / (35 / 12) ** 0.5, rel=1e-6)


def test_whiten_targets_whitens_the_advantages_and_leaves_the_returns():
    algo = _algo(gamma=1.0, lam=0.5)
    batch = [TrainSample([1], [3, 4], [0.0, 0.0], 0.0, reward=r) for r in (1.0, 0.0)]
    targets = [with_critic_targets(s, [0.0, 0.0], algo) for s in batch]
    # values 0, γ 1, λ 0.5: advantages [0.5, 1] and [0, 0] (the returns the same)
    assert [t.token_advantages for t in targets] == [[0.5, 1.0], [0.0, 0.0]]
    sums = _sums([t.token_advantages for t in targets])
    got = whiten_targets(targets, sums, algo)
    mean, std = 0.375, (0.3125 - 0.375 ** 2) ** 0.5  # (0.25 + 1) / 4 = 0.3125
    assert _flat(t.token_advantages for t in got) == pytest.approx(
        [(0.5 - mean) / (std + EPS), (1.0 - mean) / (std + EPS), -mean / (std + EPS), -mean / (std + EPS)], abs=1e-12)
    assert [t.returns for t in got] == [[0.5, 1.0], [0.0, 0.0]]  # the critic's targets stay raw


def test_switched_off_the_advantages_are_todays_gae():
    algo = _algo(gamma=0.9, lam=0.5, whiten_advantages=False)
    s = TrainSample([1], [3, 4, 5], [0.0] * 3, 0.0, reward=1.0)
    t = with_critic_targets(s, [0.5, 0.2, 0.4], algo)
    assert whiten_targets([t], _sums([t.token_advantages]), algo) == [t]
    # tests/workers/train/test_algorithms.py's hand computation, unchanged
    assert t.token_advantages == pytest.approx(gae([0, 0, 1], [0.5, 0.2, 0.4], 0.9, 0.5)[0])
    # δ = (−0.32, 0.16, 0.6); A_2 = 0.6, A_1 = 0.16 + 0.45·0.6 = 0.43, A_0 = −0.32 + 0.45·0.43
    assert t.token_advantages == pytest.approx([-0.1265, 0.43, 0.6], abs=1e-12)


def test_ranks_whiten_with_the_whole_batchs_statistics():
    """Each rank holds its share; the all-reduce adds the shares' moments, so every rank
    whitens as one process does over the whole batch."""
    algo = _algo()
    batch = [TrainSample([1], [3] * len(a), [0.0] * len(a), 0.0, values=[0.0] * len(a), returns=list(a),
                         token_advantages=list(a)) for a in ([0.0, 4.0, 4.0], [0.0], [1.0, 2.0])]
    whole = whiten_targets(batch, _sums([s.token_advantages for s in batch]), algo)
    shares = [batch[:1], batch[1:]]
    moments = [torch.tensor([v for v in _sums([s.token_advantages for s in share]).values()], dtype=torch.float64)
               for share in shares]
    for r, share in enumerate(shares):
        def all_reduce(t, r=r):
            t.add_(moments[1 - r])
        got = whiten_targets(share, _sums([s.token_advantages for s in share]), algo, all_reduce)
        want = whole[:1] if r == 0 else whole[1:]
        assert _flat(s.token_advantages for s in got) == pytest.approx(_flat(s.token_advantages for s in want),
                                                                      abs=1e-12)


def test_the_kl_in_the_reward_is_minus_kl_coef_times_the_log_ratio_per_token():
    # log π_old − log π_ref = 0.5, −0.25, 1.0; kl_coef 0.1; the reward 2 on the last token
    assert kl_rewards(2.0, [-1.0, -2.0, -0.5], [-1.5, -1.75, -1.5], 0.1) == pytest.approx(
        [-0.05, 0.025, 1.9], abs=1e-15)
    assert kl_rewards(1.0, [], [], 0.1) == []
    with pytest.raises(ValueError, match="reference log-probs"):
        kl_rewards(1.0, [-1.0], [], 0.1)


def test_the_kl_charged_to_the_rewards_is_reported_per_token_and_adds_up_over_ranks():
    from workers.train.algorithms import critic_sums, critic_stats

    values, returns, adv = [[0.0, 0.0], [0.0]], [[1.0, 1.0], [0.0]], [[1.0, 1.0], [0.0]]
    one = critic_sums(values[:1], returns[:1], adv[:1], kl=[[0.5, -0.25]])
    two = critic_sums(values[1:], returns[1:], adv[1:], kl=[[1.0]])
    whole = {k: one[k] + two[k] for k in one}
    assert critic_stats(whole)["reward/kl"] == pytest.approx((0.5 - 0.25 + 1.0) / 3, abs=1e-15)
    assert "reward/kl" not in critic_stats(critic_sums(values, returns, adv))  # kl_penalty loss: no such metric


def test_gae_takes_the_kl_rewards_with_kl_penalty_reward():
    algo = _algo(kl_coef=0.1, kl_penalty="reward", gamma=1.0, lam=1.0, whiten_advantages=False)
    s = TrainSample([1], [3, 4, 5], [-1.0, -2.0, -0.5], 0.0, reward=2.0, ref_logprobs=[-1.5, -1.75, -1.5])
    t = with_critic_targets(s, [0.0, 0.0, 0.0], algo)
    # values 0, γ = λ = 1: each advantage is the rewards to go, −0.05 + 0.025 + 1.9 = 1.875, ...
    assert t.token_advantages == pytest.approx([1.875, 1.925, 1.9], abs=1e-12)
    assert t.returns == pytest.approx([1.875, 1.925, 1.9], abs=1e-12)
    loss_kl = with_critic_targets(s, [0.0] * 3, _algo(kl_coef=0.1, gamma=1.0, lam=1.0, whiten_advantages=False))
    assert loss_kl.token_advantages == [2.0, 2.0, 2.0]  # kl_penalty loss: the rewards have no KL
    with pytest.raises(RuntimeError, match="reference log-probs"):
        with_critic_targets(dataclasses.replace(s, ref_logprobs=None), [0.0] * 3, algo)


def test_kl_in_the_reward_needs_gae_and_takes_the_kl_out_of_the_pipelines_loss():
    with pytest.raises(SpecError, match="kl_penalty 'reward'"):
        validate_spec({"name": "w", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
                       "algorithm": {"kl_coef": 0.1, "kl_penalty": "reward"}})
    raw = {"name": "p", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
           "trainer": {"pipeline": {"stages": 2}},
           "algorithm": {"advantage": "gae", "kl_coef": 0.1, "kl_reference": "stage"}}
    assert Hyper.of(validate_spec(raw), 1.0).kl_coef == 0.1
    raw["algorithm"]["kl_penalty"] = "reward"
    assert Hyper.of(validate_spec(raw), 1.0).kl_coef == 0.0


# -- inside the DeepSpeed trainer on the tiny model --------------------------------------------
def _trainer_spec(**algorithm):
    return validate_spec({
        "name": "whiten", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
        "algorithm": {"advantage": "gae", "lr": 1e-3, "warmup_steps": 0, "lam": 0.5, "minibatches": 1, **algorithm},
        "critic": {"lr": 3e-3}, "trainer": {"micro_batch_tokens": 32},
    })


def _on_policy(trainer, rewards):
    from workers.models.tinymodel import encode

    batch = [TrainSample(encode(f"{i}+{i}="), [3, 4, 5, 6], [0.0] * 4, 0.0, reward=r) for i, r in enumerate(rewards)]
    return [dataclasses.replace(s, behav_logprobs=lp) for s, lp in zip(batch, trainer.proximal_logprobs(batch))]


@pytest.mark.engine
@pytest.mark.timeout(300)
def test_the_trainer_whitens_gae_over_the_batch_and_trains_on_it(tiny_model_path):
    from workers.train.trainer import Trainer

    trainer = Trainer(_trainer_spec(), tiny_model_path, threads=1)
    batch = _on_policy(trainer, [1.0, 0.0, 2.0])
    targets, sums = trainer.critic_targets(batch)
    # the critic starts at 0: raw advantages 0.5^(3-t)·reward (tests/workers/train/test_critic.py)
    raw = [0.125, 0.25, 0.5, 1.0, 0.0, 0.0, 0.0, 0.0, 0.25, 0.5, 1.0, 2.0]
    mean = sum(raw) / 12
    std = (sum(a * a for a in raw) / 12 - mean * mean) ** 0.5
    got = [a for s in targets for a in s.token_advantages]
    assert got == pytest.approx([(a - mean) / (std + EPS) for a in raw], abs=1e-9)
    assert sums["a"] == pytest.approx(sum(raw))  # the statistics reported are the raw advantages'
    assert [r for s in targets for r in s.returns] == pytest.approx(raw)  # the critic's targets stay raw
    stats = trainer.train_step(batch)
    # on-policy, one step: the loss is minus the mean advantage over the tokens, 0 once whitened
    assert stats["loss/policy"] == pytest.approx(0.0, abs=1e-6)
    assert stats["critic/adv_mean"] == pytest.approx(mean, rel=1e-9)


@pytest.mark.engine
@pytest.mark.timeout(300)
def test_the_trainers_reference_gives_gae_its_kl_rewards(tiny_model_path):
    """kl_penalty 'reward' with the trainer's reference: log π_ref is the starting policy's, so
    with behaviour log-probs 0.5 above the policy's each token's reward is −kl_coef·0.5, and
    the loss carries no KL term."""
    from workers.train.trainer import Trainer

    trainer = Trainer(_trainer_spec(kl_coef=0.2, kl_penalty="reward", gamma=1.0, lam=1.0, whiten_advantages=False),
                      tiny_model_path, threads=1)
    batch = [dataclasses.replace(s, behav_logprobs=[lp + 0.5 for lp in s.behav_logprobs])
             for s in _on_policy(trainer, [1.0, 0.0])]
    targets, _ = trainer.critic_targets(batch)
    for s, t in zip(batch, targets):
        assert t.ref_logprobs == pytest.approx([lp - 0.5 for lp in s.behav_logprobs], abs=1e-5)
    # values 0, γ = λ = 1: rewards to go, −0.1 a token and the reward on the last
    assert _flat(t.token_advantages for t in targets) == pytest.approx(
        [0.6, 0.7, 0.8, 0.9, -0.4, -0.3, -0.2, -0.1], abs=1e-5)
    stats = trainer.train_step(batch)
    assert stats["loss/kl"] == 0.0
    # the KL the rewards paid is reported per token: log π_old − log π_ref = 0.5 on every token
    assert stats["reward/kl"] == pytest.approx(0.5, abs=1e-5)


@pytest.mark.engine
@pytest.mark.timeout(300)
def test_two_ranks_whiten_with_the_whole_batchs_statistics(tiny_model_path):
    """Each rank's critic values its share; the whitening statistics are all-reduced, so the
    step's policy loss (taken before any weight moves) is one process's on the whole batch.
    Behaviour log-probs 0.1·(i + 1) below the policy's weight sample i's tokens by e^0.1(i+1),
    so the loss −Σ w·A / tokens depends on which mean and std whitened the advantages."""
    from workers.train.ranks import TrainerGroup
    from workers.train.trainer import Trainer

    spec = _trainer_spec()
    one = Trainer(spec, tiny_model_path, threads=1)
    batch = _on_policy(one, [2.0, 0.0, 0.0, 1.0])
    batch = [dataclasses.replace(s, token_ids=s.token_ids[:n], behav_logprobs=[lp - 0.1 * (i + 1)
                                                                               for lp in s.behav_logprobs[:n]])
             for i, (s, n) in enumerate(zip(batch, (4, 4, 2, 3)))]  # uneven: the shares hold different tokens
    want = one.train_step(batch)
    assert abs(want["loss/policy"]) > 1e-3
    with TrainerGroup(spec, tiny_model_path, 2, 1, 0) as group:
        got = group.train_step(batch)
    for key in ("loss/policy", "critic/adv_mean", "critic/adv_std", "critic/value_loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
