"""Exact numbers for the RL maths (hand-computed in the comments)."""
import math

import pytest
import torch

from workers.algorithms import (
    group_advantages, kl_penalty, normalizer, pack_first_fit_decreasing, ppo_decoupled_loss, reinforce_tis_loss,
)


def test_group_advantage_is_reward_minus_group_mean():
    assert group_advantages([1, 0, 0, 1, 1, 1, 1, 1], 4) == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]


def test_group_advantage_divides_by_group_std_when_asked():
    adv = group_advantages([1, 0, 0, 1], 4, std_norm=True)  # mean 0.5, std 0.5
    assert adv == pytest.approx([1, -1, -1, 1], abs=1e-5)


def test_group_advantage_rejects_ragged_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages([1, 0, 1], 4)


def _ppo_example(adv):
    # token 1: ratio π/π_prox = 1.5 (clipped to 1.2), weight π_prox/μ = 2
    # token 2: ratio 0.9 (inside the clip range), weight 10 capped to 5
    logp = torch.tensor([[math.log(1.5), math.log(0.9)]], requires_grad=True)
    prox = torch.zeros(1, 2)
    behav = torch.tensor([[math.log(0.5), math.log(0.1)]])
    out = ppo_decoupled_loss(logp, prox, behav, torch.tensor([adv]), torch.ones(1, 2), clip=0.2,
                             behav_weight_cap=5.0, denominator=2.0)
    out.loss.backward()
    return out, logp.grad


def test_decoupled_ppo_loss_matches_hand_computation():
    out, grad = _ppo_example(1.0)
    # loss = −(2·1.2 + 5·0.9) / 2 tokens = −3.45
    assert out.loss.item() == pytest.approx(-3.45, abs=1e-6)
    assert out.clip_frac == 0.5
    assert out.behav_weight_mean == pytest.approx(3.5)
    # the clipped token gets no gradient; the other −w·ratio·A/denominator = −5·0.9/2
    assert grad.tolist()[0] == pytest.approx([0.0, -2.25], abs=1e-6)


def test_decoupled_ppo_takes_the_pessimistic_side_for_negative_advantage():
    out, grad = _ppo_example(-1.0)
    # token 1: min(1.5·−1, 1.2·−1) = −1.5 (not clipped); token 2: min(−0.9, −0.9) = −0.9
    assert out.loss.item() == pytest.approx(-(2 * -1.5 + 5 * -0.9) / 2, abs=1e-6)
    assert out.clip_frac == 0.0
    assert grad.tolist()[0] == pytest.approx([2 * 1.5 / 2, 5 * 0.9 / 2], abs=1e-6)


def test_reinforce_with_truncated_importance_weights_matches_hand_computation():
    logp = torch.tensor([[math.log(0.5), math.log(0.2)]], requires_grad=True)
    behav = torch.tensor([[math.log(0.25), math.log(0.4)]])  # raw weights 2 and 0.5; cap 1.5
    out = reinforce_tis_loss(logp, behav, torch.tensor([2.0]), torch.ones(1, 2), weight_cap=1.5, denominator=1.0)
    out.loss.backward()
    expected = -1.5 * 2 * math.log(0.5) - 0.5 * 2 * math.log(0.2)  # 3.688879
    assert out.loss.item() == pytest.approx(expected, abs=1e-5)
    assert out.clip_frac == 0.5
    assert logp.grad.tolist()[0] == pytest.approx([-3.0, -1.0], abs=1e-6)


def test_masked_tokens_contribute_nothing():
    logp = torch.tensor([[math.log(0.5), math.log(0.2)]])
    behav = logp.clone()
    out = reinforce_tis_loss(logp, behav, torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]), 5.0, 1.0)
    assert out.loss.item() == pytest.approx(-math.log(0.5), abs=1e-6)
    assert out.tokens == 1


def test_k3_kl_estimator_matches_hand_computation():
    kl = kl_penalty(torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]]), torch.ones(1, 1), 1.0)
    assert kl.item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)  # 0.193147


def test_normalizer_counts_tokens_or_sequences():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert normalizer(mask, "tokens") == 3.0
    assert normalizer(mask, "batch") == 2.0


def test_packing_is_first_fit_decreasing_by_padded_tokens():
    # sorted: 8(#2) 7(#4) 5(#0) 3(#1) 2(#3) 1(#5); a bin costs rows × its longest row
    assert pack_first_fit_decreasing([5, 3, 8, 2, 7, 1], 10) == [[2], [4], [0, 1], [3, 5]]


def test_packing_gives_an_oversized_sequence_its_own_micro_batch():
    assert pack_first_fit_decreasing([12, 3, 3], 10) == [[0], [1, 2]]


def test_packed_loss_equals_unpacked_loss():
    torch.manual_seed(0)
    logp, prox, behav = (torch.randn(4, 6) * 0.1 - 1 for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.float)
    adv = torch.tensor([0.5, -1.0, 2.0, 0.0])
    den = normalizer(mask, "tokens")
    whole = ppo_decoupled_loss(logp, prox, behav, adv, mask, 0.2, 5.0, den).loss
    parts = sum(ppo_decoupled_loss(logp[idx], prox[idx], behav[idx], adv[idx], mask[idx], 0.2, 5.0, den).loss
                for idx in ([1], [0, 3], [2]))
    assert parts.item() == pytest.approx(whole.item(), abs=1e-6)


def test_lr_factor_warms_up_then_decays_to_the_floor_at_the_last_step():
    from workers.algorithms import lr_factor

    assert [lr_factor(s, warmup=3) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    # linear: 1 at the end of warm-up, the floor at step `total`, and it stays there
    assert lr_factor(2, 2, "linear", total=12, floor=0.1) == 1.0
    assert lr_factor(7, 2, "linear", total=12, floor=0.1) == pytest.approx(0.55)
    assert lr_factor(12, 2, "linear", total=12, floor=0.1) == pytest.approx(0.1)
    assert lr_factor(50, 2, "linear", total=12, floor=0.1) == pytest.approx(0.1)
    # cosine: half way is the mean of 1 and the floor
    assert lr_factor(7, 2, "cosine", total=12, floor=0.0) == pytest.approx(0.5)
    assert lr_factor(12, 2, "cosine", total=12, floor=0.2) == pytest.approx(0.2)
    # constant ignores total and floor
    assert lr_factor(100, 2, "constant", total=12, floor=0.1) == 1.0
