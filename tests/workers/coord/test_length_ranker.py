"""The online output-length ranker: learns chain lengths, exact ranking metrics, determinism."""
import math
import random

import numpy as np
import pytest

from workers.coord.length_ranker import LengthRanker, featurize, rank, spearman, top_recall
from workers.tasks.datasets import gen_chain


def _chain_stream(n, seed=3):
    """(prompt, length) like a run's finished samples: answer + EOS, with sampling noise."""
    rng = random.Random(seed)
    return [(r["prompt"], max(1, round((len(r["answer"]) + 1) * rng.lognormvariate(0, 0.3))))
            for r in gen_chain(n, seed=seed)]


def test_ranks_average_ties():
    assert rank([10, 30, 20, 30]).tolist() == [1.0, 3.5, 2.0, 3.5]


def test_spearman_is_one_for_a_monotone_predictor_and_zero_for_a_constant():
    assert spearman([1, 2, 3, 4], [10, 20, 35, 90]) == pytest.approx(1.0)
    assert spearman([4, 3, 2, 1], [10, 20, 35, 90]) == pytest.approx(-1.0)
    assert spearman([5, 5, 5, 5], [10, 20, 35, 90]) == 0.0


def test_top_recall_counts_the_true_longest_and_splits_ties():
    actual = list(range(1, 11))  # the longest (q = 0.2 → 2) are 9 and 10
    assert top_recall([0, 0, 0, 0, 0, 0, 0, 0, 1, 1], actual, q=0.2) == 1.0
    assert top_recall([0, 0, 0, 0, 0, 0, 0, 1, 1, 0], actual, q=0.2) == 0.5
    assert top_recall([7] * 10, actual, q=0.2) == pytest.approx(0.2)  # constant: chance level


def test_ranker_beats_a_constant_predictor_on_chain_after_500_samples():
    ranker = LengthRanker()
    stream = _chain_stream(500)
    for prompt, length in stream:
        ranker.observe(prompt, length)
    lengths = [n for _, n in stream[-512:]]
    constant = [1.0] * len(lengths)
    assert ranker.spearman() > 0.5 > spearman(constant, lengths)
    assert ranker.top_recall(0.1) > top_recall(constant, lengths, 0.1) + 0.3
    m = ranker.metrics()
    assert m["ranker/spearman"] == ranker.spearman() and m["ranker/observations"] == 500


def test_predictions_rank_more_terms_as_longer():
    ranker = LengthRanker()
    for prompt, length in _chain_stream(400):
        ranker.observe(prompt, length)
    short, long_ = ranker.predict(["3+4=", "3+4+1+8+2+9+5+6+7+2="])
    assert long_ > 2 * short


def test_same_observations_give_identical_predictions():
    stream = _chain_stream(300)
    a, b = LengthRanker(refit_every=32), LengthRanker(refit_every=32)
    for prompt, length in stream:
        a.observe(prompt, length)
        b.observe(prompt, length)
    probe = [p for p, _ in _chain_stream(20, seed=9)]
    assert a.predict(probe) == b.predict(probe)
    assert (a.spearman(), a.top_recall()) == (b.spearman(), b.top_recall())


def test_a_prompt_seen_before_is_pulled_towards_its_own_lengths():
    ranker = LengthRanker(memory_prior=1.0)
    for prompt, length in _chain_stream(200):
        ranker.observe(prompt, length)
    before = ranker.predict(["1+1="])[0]
    ranker.observe_group("1+1=", [40, 40, 40])
    assert ranker.predict(["1+1="])[0] > 3 * before


def test_a_group_is_scored_with_one_prediction_made_before_its_outcomes():
    ranker = LengthRanker()
    ranker.observe_group("2+2=", [3, 5])
    ranker.observe_group("2+2=", [7, 9])
    predicted = [p for p, _ in ranker._held_out]
    assert predicted[0] == predicted[1] == 0.0  # nothing learnt yet
    assert predicted[2] == predicted[3] > 0.0


def test_the_sliding_window_keeps_the_last_samples_and_their_sums_across_part_evicted_groups():
    # window 20, groups of 8: the oldest group leaves part by part
    ranker = LengthRanker(window=20, refit_every=5)
    rng = random.Random(3)
    observed = []
    for i in range(9):
        prompt = f"{rng.randint(0, 99)} + {rng.randint(0, 99)} = ?" + " x" * i
        lengths = [rng.randint(1, 40) for _ in range(8)]
        ranker.observe_group(prompt, lengths)
        observed += [(featurize(prompt), math.log1p(n)) for n in lengths]
    kept = observed[-20:]
    X = np.stack([x for x, _ in kept])
    y = np.array([v for _, v in kept])
    state = ranker.state_dict()
    assert state["window_x"].shape == (20, X.shape[1])
    np.testing.assert_allclose(state["window_x"].numpy(), X)
    np.testing.assert_allclose(state["window_y"].numpy(), y)
    # the running sums are those of the samples in the window, not of every sample seen
    np.testing.assert_allclose(state["sx"].numpy(), X.sum(0), atol=1e-9)
    np.testing.assert_allclose(state["sxx"].numpy(), X.T @ X, atol=1e-7)
    np.testing.assert_allclose(state["sxy"].numpy(), X.T @ y, atol=1e-9)
    assert abs(state["sy"] - y.sum()) < 1e-9
    # restored, the ranker evicts as the original does
    twin = LengthRanker.from_state_dict(state)
    ranker.observe_group("7 + 8 = ?", [5, 6, 7])
    twin.observe_group("7 + 8 = ?", [5, 6, 7])
    assert twin.predict(["1 + 2 = ?"]) == ranker.predict(["1 + 2 = ?"])
    np.testing.assert_array_equal(twin.state_dict()["sxx"].numpy(), ranker.state_dict()["sxx"].numpy())
