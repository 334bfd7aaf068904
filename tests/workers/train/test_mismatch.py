"""The trainer/engine mismatch: the corrections' exact weights (algorithm.correction) and
the mismatch metrics (mismatch/*), on hand-picked log-probs."""
import math

import pytest
import torch

from workers.train.algorithms import (Correction, MismatchSums, corrected_weights, mismatch_stats, mismatch_sums,
                                      ppo_decoupled_loss, reinforce_tis_loss)

# Three sequences, π_prox/π_behav per token (0 = padding, off the mask):
#   A: 3.0, 0.8, 1.5  (sequence ratio 3.6)
#   B: 1.2, 0.4       (0.48)
#   C: 0.9, 1.1       (0.99)
RATIOS = [[3.0, 0.8, 1.5], [1.2, 0.4, 0.0], [0.9, 1.1, 0.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
# padding carries a wild ratio: the mask must keep it out of the sequence sums
LOG_RATIO = torch.tensor([[math.log(r) if r else math.log(100.0) for r in row] for row in RATIOS])


@pytest.mark.parametrize("method, level, weights, dropped, truncated", [
    # token tis: each ratio cut to the cap 2
    ("tis", "token", [[2.0, 0.8, 1.5], [1.2, 0.4, 0.0], [0.9, 1.1, 0.0]], 0, 1),
    # token mis: 3.0 and 0.4 leave [0.5, 2]; the rest keep their ratio
    ("mis", "token", [[0.0, 0.8, 1.5], [1.2, 0.0, 0.0], [0.9, 1.1, 0.0]], 2, 0),
    # sequence tis: A's 3.6 cut to 2 on all three tokens; B, C keep their sequence ratio
    ("tis", "sequence", [[2.0, 2.0, 2.0], [0.48, 0.48, 0.0], [0.99, 0.99, 0.0]], 0, 3),
    # sequence mis: A (3.6 > 2) and B (0.48 < 0.5) masked whole; C kept at 0.99
    ("mis", "sequence", [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.99, 0.99, 0.0]], 5, 0),
])
def test_each_correction_gives_its_exact_weights(method, level, weights, dropped, truncated):
    w, was_dropped, was_truncated = corrected_weights(LOG_RATIO, MASK, Correction(method, level, cap=2.0))
    assert w.tolist() == [pytest.approx(row, abs=1e-6) for row in weights]
    assert int(was_dropped.sum()) == dropped and int(was_truncated.sum()) == truncated


def test_a_correction_replaces_decoupled_ppos_behaviour_cap_rather_than_multiplying_it():
    # π = π_prox (ratio 1, inside the clip), advantage 1: loss = −Σ w / denominator
    prox = torch.zeros(3, 3)
    behav = -LOG_RATIO
    logp = prox.clone().requires_grad_(True)
    tis = ppo_decoupled_loss(logp, prox, behav, torch.ones(3), MASK, clip=0.2, behav_weight_cap=5.0,
                             denominator=7.0, correction=Correction("tis", "token", 2.0))
    # 2 + 0.8 + 1.5 + 1.2 + 0.4 + 0.9 + 1.1 = 7.9: each ratio once, truncated, never squared
    assert tis.loss.item() == pytest.approx(-7.9 / 7.0, abs=1e-6)
    assert tis.truncated == 1 and tis.dropped == 0
    # none: AReaL's rule, drop above behav_weight_cap 2.5 (the 3.0 token), keep the others whole
    none = ppo_decoupled_loss(logp, prox, behav, torch.ones(3), MASK, clip=0.2, behav_weight_cap=2.5,
                              denominator=7.0, correction=Correction("none"))
    assert none.loss.item() == pytest.approx(-(0.8 + 1.5 + 1.2 + 0.4 + 0.9 + 1.1) / 7.0, abs=1e-6)
    assert none.dropped == 1 and none.truncated == 0
    mis = ppo_decoupled_loss(logp, prox, behav, torch.ones(3), MASK, clip=0.2, behav_weight_cap=5.0,
                             denominator=7.0, correction=Correction("mis", "sequence", 2.0))
    assert mis.loss.item() == pytest.approx(-2 * 0.99 / 7.0, abs=1e-6)
    assert mis.dropped == 5 and mis.tokens == 7


def test_reinforce_token_tis_is_its_own_truncation_at_the_same_cap():
    behav = -LOG_RATIO
    logp = torch.zeros(3, 3, requires_grad=True)
    adv = torch.tensor([1.0, -0.5, 2.0])
    own = reinforce_tis_loss(logp, behav, adv, MASK, weight_cap=2.0, denominator=7.0)
    tis = reinforce_tis_loss(logp, behav, adv, MASK, weight_cap=5.0, denominator=7.0,
                             correction=Correction("tis", "token", 2.0))
    assert torch.equal(own.weights, tis.weights) and own.truncated == tis.truncated == 1
    mis = reinforce_tis_loss(logp, behav, adv, MASK, weight_cap=5.0, denominator=7.0,
                             correction=Correction("mis", "token", 2.0))
    assert mis.dropped == 2
    assert mis.behav_weight_mean == pytest.approx((0.8 + 1.5 + 1.2 + 0.9 + 1.1) / 5, abs=1e-6)


def test_a_correction_needs_a_cap_above_one_and_known_names():
    with pytest.raises(ValueError):
        Correction("tis", "token", 1.0)
    with pytest.raises(ValueError):
        Correction("clip")
    with pytest.raises(ValueError):
        Correction("mis", "word")


# Four tokens, log-ratios 0, log 2, −log 2, 0.1, at staleness 0, 0, 1, 5 (a fifth is padding), in
# float64 so that the ratios 0.5 and 2 sit exactly on their bins' lower edges.
R = torch.tensor([[0.0, math.log(2.0), -math.log(2.0), 0.1, 9.0]], dtype=torch.float64)
STALE = torch.tensor([[0, 0, 1, 5, 0]])
M = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
K3 = [0.0, 1 - math.log(2.0), math.log(2.0) - 0.5, math.exp(0.1) - 1.1]  # e^r − 1 − r


def test_the_mismatch_metrics_split_by_staleness_with_exact_numbers():
    stats = mismatch_stats(mismatch_sums(R, M, STALE), tokens=4, dropped=1, truncated=2)
    assert stats["mismatch/kl"] == pytest.approx(sum(K3) / 4, abs=1e-12)
    assert stats["mismatch/abs_logp_mean"] == pytest.approx((2 * math.log(2.0) + 0.1) / 4, abs=1e-12)
    assert stats["mismatch/abs_logp_max"] == pytest.approx(math.log(2.0), abs=1e-12)
    assert stats["mismatch/kl_stale0"] == pytest.approx((K3[0] + K3[1]) / 2, abs=1e-12)
    assert stats["mismatch/kl_stale1"] == pytest.approx(K3[2], abs=1e-12)
    assert stats["mismatch/kl_stale3plus"] == pytest.approx(K3[3], abs=1e-12)  # staleness 5
    assert "mismatch/kl_stale2" not in stats  # no token that stale
    assert stats["mismatch/abs_logp_max_stale1"] == pytest.approx(math.log(2.0), abs=1e-12)
    # ratios 1, 2, 0.5, 1.105: one each in the bins from 0.95, 2, 0.5 and 1.05 (shares of 4 tokens)
    hist = {k.rsplit("/", 1)[1]: v for k, v in stats.items() if k.startswith("mismatch/ratio_hist/")}
    assert hist == {"0": 0.0, "0.5": 0.25, "0.8": 0.0, "0.95": 0.25, "1.05": 0.25, "1.25": 0.0, "2": 0.25}
    # quantiles to 0.01 in log-ratio: the smallest (0.5 → bin −69), the 2nd (1 → bin 0), the largest
    assert stats["mismatch/ratio_p1"] == pytest.approx(math.exp(-0.69), abs=1e-12)
    assert stats["mismatch/ratio_p50"] == 1.0
    assert stats["mismatch/ratio_p99"] == pytest.approx(math.exp(0.69), abs=1e-12)
    assert stats["mismatch/dropped_share"] == 0.25 and stats["mismatch/truncated_share"] == 0.5


def test_mismatch_sums_of_parts_add_up_to_those_of_the_whole():
    whole = mismatch_sums(R, M, STALE)
    first, second = M.clone(), M.clone()
    first[0, 2:] = 0
    second[0, :2] = 0
    parts = MismatchSums.zeros().add(mismatch_sums(R, first, STALE)).add(mismatch_sums(R, second, STALE))
    assert parts.stats() == pytest.approx(whole.stats())
    assert whole.tokens == 4 and MismatchSums.zeros().stats() == {}


def test_tokens_of_unknown_version_count_in_the_totals_only():
    stats = mismatch_sums(R, M).stats()
    assert stats["mismatch/kl"] == pytest.approx(sum(K3) / 4, abs=1e-12)
    assert not any("stale" in k for k in stats)
