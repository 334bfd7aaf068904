"""Exact numbers for the RL maths (hand-computed in the comments)."""
import math

import pytest
import torch

from workers.train.algorithms import (
    critic_stats, critic_sums, gae, group_advantages, kl_penalty, normalizer, pack_first_fit_decreasing,
    ppo_decoupled_loss, reinforce_tis_loss, terminal_rewards, token_logprobs, truncated_logits, value_loss,
)


def test_group_advantage_is_reward_minus_group_mean():
    assert group_advantages([1, 0, 0, 1, 1, 1, 1, 1], 4) == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]


def test_group_advantage_divides_by_group_std_when_asked():
    adv = group_advantages([1, 0, 0, 1], 4, std_norm=True)  # mean 0.5, std 0.5
    assert adv == pytest.approx([1, -1, -1, 1], abs=1e-5)


def test_gae_matches_hand_computation():
    # rewards [0, 0, 1], values [0.5, 0.2, 0.4], γ 0.9, λ 0.5 (γλ = 0.45), V after the end = 0:
    # δ2 = 1 - 0.4 = 0.6; δ1 = 0.9·0.4 - 0.2 = 0.16; δ0 = 0.9·0.2 - 0.5 = -0.32
    # A2 = 0.6; A1 = 0.16 + 0.45·0.6 = 0.43; A0 = -0.32 + 0.45·0.43 = -0.1265
    adv, ret = gae([0, 0, 1], [0.5, 0.2, 0.4], gamma=0.9, lam=0.5)
    assert adv == pytest.approx([-0.1265, 0.43, 0.6], abs=1e-12)
    assert ret == pytest.approx([0.3735, 0.63, 1.0], abs=1e-12)  # A + V


def test_gae_with_lambda_1_is_the_discounted_return_minus_the_value():
    adv, ret = gae([0, 0, 2], [0.3, -0.1, 0.7], gamma=0.5, lam=1.0)
    assert ret == pytest.approx([0.5, 1.0, 2.0])  # 2·γ², 2·γ, 2: the values cancel out
    assert adv == pytest.approx([0.2, 1.1, 1.3])


def test_gae_with_lambda_0_is_the_one_step_td_error():
    adv, _ = gae([0, 0, 1], [0.5, 0.2, 0.4], gamma=1.0, lam=0.0)
    assert adv == pytest.approx([0.2 - 0.5, 0.4 - 0.2, 1 - 0.4])


def test_gae_rejects_values_that_do_not_match_the_rewards():
    with pytest.raises(ValueError, match="3 rewards but 2 values"):
        gae([0, 0, 1], [0.1, 0.2], 1.0, 1.0)


def test_a_sequence_reward_lands_on_its_last_token():
    assert terminal_rewards(0.7, 3) == [0.0, 0.0, 0.7] and terminal_rewards(1.0, 1) == [1.0]
    assert terminal_rewards(1.0, 0) == []


def test_clipped_value_loss_takes_the_larger_error_per_token():
    # old 0.0, clip 0.2, returns 1.0. Token 1: V = 0.5, clipped 0.2: max(0.25, 0.64) = 0.64 (clipped side).
    # Token 2: V = -0.5, clipped -0.2: max(2.25, 1.44) = 2.25. Token 3: masked out.
    values = torch.tensor([[0.5, -0.5, 3.0]], requires_grad=True)
    loss, clip_frac = value_loss(values, torch.zeros(1, 3), torch.ones(1, 3), torch.tensor([[1.0, 1.0, 0.0]]),
                                 clip=0.2, denominator=2.0)
    assert float(loss) == pytest.approx(0.5 * (0.64 + 2.25) / 2)
    assert clip_frac == 0.5
    loss.backward()
    # the clipped side's gradient is 0 (V_clip is constant past the clip); the other is (V - R)/2
    assert values.grad[0].tolist() == pytest.approx([0.0, -0.75, 0.0])


def _explained(values, returns):
    return critic_stats(critic_sums([values], [returns], [[0.0] * len(values)]))["critic/explained_var"]


def test_explained_variance_is_one_for_a_perfect_critic_and_zero_for_the_mean():
    returns = [1.0, 0.0, 1.0, 0.0]
    assert _explained(returns, returns) == 1.0
    assert _explained([0.5] * 4, returns) == 0.0
    assert _explained([0.0, 1.0, 0.0, 1.0], returns) == pytest.approx(-3.0)  # 1 - Var(±1)/0.25
    assert _explained([0.2, 0.3], [1.0, 1.0]) == 0.0  # constant returns: nothing to explain


def test_critic_statistics_of_two_ranks_sums_equal_those_of_the_whole_batch():
    values, returns, adv = [[0.1, 0.2], [0.0, 0.5, 0.3]], [[1.0, 0.0], [0.5, 0.5, 1.0]], [[0.9, -0.2], [0.5, 0.0, 0.7]]
    whole = critic_stats(critic_sums(values, returns, adv))
    one, two = critic_sums(values[:1], returns[:1], adv[:1]), critic_sums(values[1:], returns[1:], adv[1:])
    assert critic_stats({k: one[k] + two[k] for k in one}) == pytest.approx(whole)
    # by hand: 5 tokens; advantages 0.9, -0.2, 0.5, 0, 0.7: mean 0.38, variance 1.59/5 - 0.38² = 0.1736
    assert whole["critic/adv_mean"] == pytest.approx(0.38) and whole["critic/adv_std"] == pytest.approx(0.1736 ** 0.5)
    assert whole["critic/value_mean"] == pytest.approx(0.22) and whole["critic/return_mean"] == pytest.approx(0.6)


def test_group_advantage_rejects_ragged_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages([1, 0, 1], 4)


def _ppo_example(adv):
    # token 1: ratio π/π_prox = 1.5 (clipped to 1.2), weight π_prox/μ = 2
    # token 2: ratio 0.9 (inside the clip range), weight 10: past the cap of 5, so dropped
    # token 3: ratio 1.1 (inside), weight 4 (under the cap)
    logp = torch.tensor([[math.log(1.5), math.log(0.9), math.log(1.1)]], requires_grad=True)
    prox = torch.zeros(1, 3)
    behav = torch.tensor([[math.log(0.5), math.log(0.1), math.log(0.25)]])
    out = ppo_decoupled_loss(logp, prox, behav, torch.tensor([adv]), torch.ones(1, 3), clip=0.2,
                             behav_weight_cap=5.0, denominator=3.0)
    out.loss.backward()
    return out, logp.grad


def test_decoupled_ppo_loss_matches_hand_computation():
    out, grad = _ppo_example(1.0)
    # loss = −(2·1.2 + 0 + 4·1.1) / 3 tokens = −6.8 / 3
    assert out.loss.item() == pytest.approx(-6.8 / 3, abs=1e-6)
    assert out.clip_frac == pytest.approx(1 / 3)
    assert out.behav_weight_mean == pytest.approx(3.0)  # (2 + 4) / 2 kept tokens
    assert out.dropped == 1 and out.tokens == 3
    assert out.weights.tolist()[0] == pytest.approx([2.0, 0.0, 4.0])
    # the clipped token and the dropped one get no gradient; the third −w·ratio·A/denominator
    assert grad.tolist()[0] == pytest.approx([0.0, 0.0, -4 * 1.1 / 3], abs=1e-6)


def test_decoupled_ppo_takes_the_pessimistic_side_for_negative_advantage():
    out, grad = _ppo_example(-1.0)
    # token 1: min(1.5·−1, 1.2·−1) = −1.5 (not clipped); token 2 dropped; token 3: −1.1
    assert out.loss.item() == pytest.approx(-(2 * -1.5 + 4 * -1.1) / 3, abs=1e-6)
    assert out.clip_frac == 0.0
    assert grad.tolist()[0] == pytest.approx([2 * 1.5 / 3, 0.0, 4 * 1.1 / 3], abs=1e-6)


def test_decoupled_ppo_binds_once_the_policy_has_moved_from_its_proximal_policy():
    """With π = π_prox (one optimiser step per batch) the ratio is 1 and nothing clips;
    once an earlier minibatch has moved π, the clip binds and the gradient differs from
    REINFORCE's."""
    behav = torch.log(torch.tensor([[0.5, 0.5]]))
    prox = behav.clone()
    moved = torch.log(torch.tensor([[0.7, 0.3]])).requires_grad_()
    ppo = ppo_decoupled_loss(moved, prox, behav, torch.tensor([1.0]), torch.ones(1, 2), 0.2, 5.0, 2.0)
    ppo.loss.backward()
    assert ppo.clip_frac == 0.5  # 0.7/0.5 = 1.4 > 1.2: clipped, no gradient
    assert moved.grad.tolist()[0] == pytest.approx([0.0, -0.3 / 0.5 / 2], abs=1e-6)
    same = behav.clone().requires_grad_()
    assert ppo_decoupled_loss(same, same.detach(), behav, torch.tensor([1.0]), torch.ones(1, 2), 0.2, 5.0,
                              2.0).clip_frac == 0.0


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
    kl = kl_penalty(torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]]), torch.ones(1, 1), 1.0,
                    estimator="k3")
    assert kl.item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)  # 0.193147


def test_k2_kl_is_half_the_squared_log_ratio_weighted_per_token():
    logp = torch.tensor([[math.log(0.5), math.log(0.2)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.2)]])
    kl = kl_penalty(logp, ref, torch.ones(1, 2), 2.0, estimator="k2", weights=torch.tensor([[3.0, 1.0]]))
    kl.backward()
    assert kl.item() == pytest.approx(3 * 0.5 * math.log(2) ** 2 / 2, abs=1e-6)  # 0.360336
    assert logp.grad.tolist()[0] == pytest.approx([3 * math.log(2) / 2, 0.0], abs=1e-6)


def _exact_kl_gradient(estimator):
    """The gradient of E_{x~π}[estimator] taken as a loss, summed exactly over a 3-token
    vocabulary (each x weighted by π(x), as sampling would), against ∇KL(π‖π_ref)."""
    theta = torch.tensor([0.3, -0.2, 0.5], requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.4, -0.1]), -1)

    def grad(f):
        logp = torch.log_softmax(theta, -1)
        (g,) = torch.autograd.grad(f(logp), theta)
        return g

    estimated = grad(lambda logp: kl_penalty(logp[None], ref[None], logp.exp().detach()[None], 1.0,
                                             estimator=estimator))
    true = grad(lambda logp: (logp.exp() * (logp - ref)).sum())
    reverse = grad(lambda logp: (ref.exp() * (ref - logp)).sum())
    return estimated, true, reverse


def test_k2_as_a_loss_has_the_gradient_of_kl_policy_to_reference():
    estimated, true, _ = _exact_kl_gradient("k2")
    assert estimated.tolist() == pytest.approx(true.tolist(), abs=1e-6)


def test_k3_as_a_loss_has_the_gradient_of_the_reverse_kl():
    estimated, true, reverse = _exact_kl_gradient("k3")
    assert estimated.tolist() == pytest.approx(reverse.tolist(), abs=1e-6)
    assert estimated.tolist() != pytest.approx(true.tolist(), abs=1e-3)


def test_top_k_then_top_p_truncation_matches_the_samplers_rule():
    logits = torch.log(torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]))
    # top-k 4 drops 0.05; top-p 0.8 over the rest (renormalised 0.421, 0.105, 0.316, 0.158,
    # ascending 0.105, 0.158, 0.316, 0.421; cumulative 0.105, 0.263, ...): 0.105 ≤ 0.2 is
    # dropped, 0.263 > 0.2 stays
    kept = torch.isfinite(truncated_logits(logits, top_k=4, top_p=0.8)).tolist()
    assert kept == [False, True, False, True, True]
    assert torch.isfinite(truncated_logits(logits, top_k=1)).tolist() == [False, True, False, False, False]
    assert torch.isfinite(truncated_logits(logits, top_p=0.01)).tolist() == [False, True, False, False, False]
    # a sampled token is never masked, and the log-probs are the renormalised ones
    logp, entropy = token_logprobs(logits[None, None], torch.tensor([[2]]), top_k=2, with_entropy=True)
    assert logp.item() == pytest.approx(math.log(0.1 / 0.8), abs=1e-6)  # kept set {0.4, 0.3, 0.1}
    p = torch.tensor([0.4, 0.3, 0.1]) / 0.8
    assert entropy.item() == pytest.approx(float(-(p * p.log()).sum()), abs=1e-6)


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
    from workers.train.algorithms import lr_factor

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
