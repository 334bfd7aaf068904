"""An episode's loss mask through the trainer: observation tokens count in no loss, gradient,
metric or denominator; GAE runs over the generated tokens alone; the packed ids read back
at the trained positions are the engine's."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from workers.train import algorithms
from workers.train.batching import completion_mask, pad_sequences, per_token, token_exact, trained_ids
from workers.train.rank_messages import Sample as RankSample
from workers.train.samples import TrainSample, critic_sums_of, step_denominator, with_critic_targets

# one episode: 2 generated, 2 observation, 1 generated; and a single-turn sample
EPISODE = TrainSample([1, 2], [10, 11, 12, 13, 14], [-0.5, -0.25, 0.0, 0.0, -1.0], 1.0,
                      loss_mask=[1, 1, 0, 0, 1])
SINGLE = TrainSample([1, 2, 3], [20, 21], [-0.5, -0.5], -1.0)


def test_the_completion_mask_follows_each_samples_loss_mask():
    pairs = [(s.prompt_ids, s.token_ids) for s in (EPISODE, SINGLE)]
    mask = completion_mask(pairs, 6, [EPISODE.loss_mask, None])
    assert mask.tolist() == [[0, 1, 1, 0, 0, 1], [0, 0, 1, 1, 0, 0]]
    with pytest.raises(ValueError, match="3 entries for 5 tokens"):
        completion_mask(pairs, 6, [[1, 1, 0], None])


def test_the_token_denominator_counts_trained_tokens_only():
    assert EPISODE.trained_tokens == 3 and SINGLE.trained_tokens == 2
    assert step_denominator([EPISODE, SINGLE], "tokens") == 5.0
    assert step_denominator([EPISODE, SINGLE], "batch") == 2.0


def _loss(sample, kind, logits_seed=0):
    pairs = [(sample.prompt_ids, sample.token_ids)]
    ids, _ = pad_sequences(pairs, 0)
    columns = ids.shape[1] - 1
    mask = completion_mask(pairs, columns, [sample.loss_mask])
    torch.manual_seed(logits_seed)
    logits = torch.randn(1, columns, 32, requires_grad=True)
    logp, entropy = algorithms.token_logprobs(logits, ids[:, 1:], with_entropy=True)
    behav = per_token(pairs, columns, [sample.behav_logprobs])
    adv = torch.tensor([sample.advantage])
    denominator = step_denominator([sample], "tokens")
    if kind == "ppo":
        out = algorithms.ppo_decoupled_loss(logp, logp.detach(), behav, adv, mask, 0.2, 5.0, denominator)
    else:
        out = algorithms.reinforce_tis_loss(logp, behav, adv, mask, 5.0, denominator)
    out.loss.backward()
    mismatch = algorithms.mismatch_sums(logp.detach() - behav, mask)
    return out, logits.grad, float((entropy.detach() * mask).sum()), mismatch, mask


@pytest.mark.parametrize("kind", ["ppo", "reinforce"])
def test_a_masked_token_changes_nothing_in_the_loss_or_the_gradient(kind):
    # the observation positions' behaviour log-probs, wild on purpose: they must not matter
    wild = dataclasses.replace(EPISODE, behav_logprobs=[-0.5, -0.25, -40.0, 7.0, -1.0])
    a, grad_a, ent_a, mis_a, mask = _loss(EPISODE, kind)
    b, grad_b, ent_b, mis_b, _ = _loss(wild, kind)
    assert a.tokens == b.tokens == 3
    assert torch.equal(a.loss, b.loss) and torch.equal(grad_a, grad_b)
    assert ent_a == ent_b and torch.equal(mis_a.sums, mis_b.sums) and a.clip_frac == b.clip_frac
    # the logits predicting an observation token get no gradient at all
    on = mask[0] > 0
    assert float(grad_a[0, ~on].abs().sum()) == 0.0 and float(grad_a[0, on].abs().sum()) > 0.0
    # and the loss is the trained tokens' mean: 3 tokens, not 5
    if kind == "reinforce":
        ids, _ = pad_sequences([(EPISODE.prompt_ids, EPISODE.token_ids)], 0)
        torch.manual_seed(0)
        logits = torch.randn(1, ids.shape[1] - 1, 32)
        logp = algorithms.token_logprobs(logits, ids[:, 1:])[0][0]
        behav = torch.tensor([0.0, -0.5, -0.25, 0.0, 0.0, -1.0])
        w = torch.exp(logp - behav).clamp(max=5.0)
        expected = -(w * logp)[on].sum() / 3
        assert torch.allclose(a.loss, expected, atol=1e-6)


def test_gae_runs_over_the_generated_tokens_only_with_each_turns_reward_on_its_last_token():
    algo = SimpleNamespace(gamma=1.0, lam=1.0, kl_coef=0.0, kl_penalty="loss")
    # turn 1 reward 0.5 on id 1, final 1.0 on id 4; ids 2, 3 are the observation
    sample = dataclasses.replace(EPISODE, reward=1.5, token_rewards=[0.0, 0.5, 0.0, 0.0, 1.0])
    values = [0.1, 0.2, 9.0, 9.0, 0.4]
    out = with_critic_targets(sample, values, algo)
    # over the generated tokens (values 0.1, 0.2, 0.4; rewards 0, 0.5, 1.0), γ = λ = 1:
    # A_t = Σ r_{≥t} − V_t: 1.5 − 0.1, 1.5 − 0.2, 1.0 − 0.4; the observation's values never enter
    assert out.token_advantages == pytest.approx([1.4, 1.3, 0.0, 0.0, 0.6])
    assert out.returns == pytest.approx([1.5, 1.5, 9.0, 9.0, 1.0])
    gamma = SimpleNamespace(gamma=0.5, lam=1.0, kl_coef=0.0, kl_penalty="loss")
    out = with_critic_targets(sample, values, gamma)
    # δ over (0.1, 0.2, 0.4): δ2 = 1.0 − 0.4 = 0.6; δ1 = 0.5 + 0.5·0.4 − 0.2 = 0.5; δ0 = 0 + 0.5·0.2 − 0.1 = 0
    # A2 = 0.6, A1 = 0.5 + 0.5·0.6 = 0.8, A0 = 0 + 0.5·0.8 = 0.4
    assert out.token_advantages == pytest.approx([0.4, 0.8, 0.0, 0.0, 0.6])
    # the critic's statistics are over the 3 trained tokens
    sums = critic_sums_of([out], gamma)
    assert sums["n"] == 3.0 and sums["v"] == pytest.approx(0.7)


def test_a_single_turn_sample_keeps_its_terminal_reward_gae():
    algo = SimpleNamespace(gamma=1.0, lam=1.0, kl_coef=0.0, kl_penalty="loss")
    out = with_critic_targets(dataclasses.replace(SINGLE, reward=2.0), [0.5, 0.25], algo)
    assert out.token_advantages == pytest.approx([1.5, 1.75]) and out.returns == pytest.approx([2.0, 2.0])


def test_the_packed_ids_read_back_at_trained_positions_are_the_engines():
    pairs = [(EPISODE.prompt_ids, EPISODE.token_ids), (SINGLE.prompt_ids, SINGLE.token_ids)]
    ids, _ = pad_sequences(pairs, 0)
    mask = completion_mask(pairs, ids.shape[1] - 1, [EPISODE.loss_mask, None])
    assert trained_ids(ids, mask) == [[10, 11, 14], [20, 21]]
    assert token_exact(pairs, [EPISODE.loss_mask, None], [[10, 11, 14], [20, 21]]) == [True, True]
    # a mask off by one position, or ids the engine did not return, are caught
    assert token_exact(pairs, [[0, 1, 1, 0, 1], None], [[10, 11, 14], [20, 21]]) == [False, True]
    assert token_exact(pairs, [EPISODE.loss_mask, None], [[10, 11, 14], [20, 22]]) == [True, False]


def test_the_loss_mask_and_token_rewards_cross_to_the_data_parallel_ranks():
    from workers.train.rank_process import _Rank
    from workers.train.ranks import _sample

    sample = dataclasses.replace(EPISODE, token_rewards=[0.0, 0.5, 0.0, 0.0, 1.0])
    message = RankSample.model_validate(_sample(sample).model_dump())
    back = _Rank._samples([message])[0]
    assert back.loss_mask == [1, 1, 0, 0, 1] and back.token_rewards == [0.0, 0.5, 0.0, 0.0, 1.0]
