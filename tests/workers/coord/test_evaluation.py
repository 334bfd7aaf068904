"""pass@k's unbiased estimator and a set's metrics, to the exact number."""
from fractions import Fraction
from math import comb

import pytest

from workers.coord.evaluation import mean_pass_at_k, pass_at_k, set_metrics


def exact(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(comb(n - c, k), comb(n, k))


@pytest.mark.parametrize("n,c,k,expected", [
    (4, 0, 1, 0.0),  # no correct sample: never passes
    (4, 0, 4, 0.0),
    (4, 4, 1, 1.0),  # every sample correct
    (4, 4, 4, 1.0),
    (5, 3, 3, 1.0),  # n - c < k: any k of them hold a correct one
    (5, 4, 2, 1.0),
    (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 1, 0.3),  # pass@1 is c/n
    (10, 3, 5, 11 / 12),  # 1 - C(7,5)/C(10,5) = 1 - 21/252
    (1, 1, 1, 1.0),
    (1, 0, 1, 0.0),
])
def test_pass_at_k_is_one_minus_the_share_of_k_subsets_without_a_correct_sample(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(float(exact(n, c, k)), abs=1e-12)


def test_pass_at_k_matches_the_binomial_form_for_every_n_c_k_up_to_16():
    for n in range(1, 17):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(exact(n, c, k)), abs=1e-12), (n, c, k)


def test_pass_at_k_grows_with_k():
    for c in range(9):
        values = [pass_at_k(8, c, k) for k in range(1, 9)]
        assert values == sorted(values)


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_mean_pass_at_k_averages_over_prompts():
    # prompts with 2, 0 and 4 of 4 correct: pass@2 = (5/6 + 0 + 1) / 3
    assert mean_pass_at_k([2, 0, 4], 4, 2) == pytest.approx((5 / 6 + 0 + 1) / 3, abs=1e-12)


def test_a_sets_metrics_are_pass_at_each_k_and_the_mean_reward_of_n():
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.5, 0.0, 0.0]]  # 0.5 is below pass_reward 1: not a pass
    metrics = set_metrics("gsm", 4, [1, 2, 4], rewards, pass_reward=1.0)
    assert metrics == pytest.approx({
        "eval/gsm/pass@1": 0.25,  # (2/4 + 0/4) / 2
        "eval/gsm/pass@2": 5 / 12,  # (1 - C(2,2)/C(4,2) + 0) / 2
        "eval/gsm/pass@4": 0.5,
        "eval/gsm/avg@4": (0.5 + 0.125) / 2,  # the mean reward, partial credit included
    }, abs=1e-12)
    lenient = set_metrics("gsm", 4, [1], rewards, pass_reward=0.5)
    assert lenient["eval/gsm/pass@1"] == pytest.approx((2 / 4 + 1 / 4) / 2)


def test_sets_take_the_runs_held_out_split_or_their_own_rows_and_keep_only_what_the_check_kept(tmp_path):
    import json

    from workers.coord.evaluation import EvalSets
    from workers.spec import validate_spec

    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps({"q": f"{i}+1=", "a": str(i + 1), "level": i}) + "\n" for i in range(5)))
    spec = validate_spec({"name": "t", "model": {"path": "m"}, "task": {"dataset": "gen:add"}, "eval": {"sets": [
        {"name": "held", "prompts": 2}, {"name": "file", "dataset": str(data), "prompt_field": "q", "answer_field": "a"},
        {"name": "gen", "dataset": "gen:chain", "size": 7, "prompts": 5}]}})
    held_out = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]
    sets = EvalSets(spec)
    rows = sets.load(held_out)
    held, own, gen = sets.sets
    assert held.rows == held_out[:2] and all(a is not b for a, b in zip(held.rows, held_out))  # copies
    assert own.rows[0] == {"level": 0, "prompt": "0+1=", "answer": "1"} and len(own.rows) == 5  # fields renamed
    assert len(gen.rows) == 5 and len(rows) == 2 + 5 + 5
    sets.keep([r for r in rows if r is not own.rows[3]])  # the model check dropped one prompt (too long)
    assert [r["level"] for r in own.rows] == [0, 1, 2, 4] and len(held.rows) == 2 and len(gen.rows) == 5
