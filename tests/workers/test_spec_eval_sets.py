"""eval.sets in the run spec: defaults, old specs unchanged, and refusals naming the field."""
import pytest

from workers.spec import SpecError, validate_spec

GOOD = {"name": "t", "model": {"path": "m"}, "task": {"dataset": "gen:add"}}


def refused(sets) -> list[dict]:
    with pytest.raises(SpecError) as err:
        validate_spec({**GOOD, "eval": {"sets": sets}})
    return err.value.errors


def test_a_spec_without_sets_validates_as_before():
    old = {**GOOD, "eval": {"every_steps": 5, "prompts": 50, "samples": 4}}
    spec = validate_spec(old)
    assert spec.eval.sets == [] and spec.eval.samples == 4 and spec.eval.prompts == 50
    assert validate_spec(spec.to_dict()).to_dict() == spec.to_dict()  # a stored spec reads back the same


def test_a_set_defaults_to_the_runs_held_out_split_and_reward_with_pass_at_1_and_n():
    spec = validate_spec({**GOOD, "eval": {"sets": [{"name": "held", "n": 8}, {"name": "one", "n": 1}]}})
    held, one = spec.eval.sets
    assert held.dataset is None and held.reward is None and held.temperature is None
    assert held.k == [1, 8] and one.k == [1] and held.pass_reward == 1.0
    again = validate_spec(spec.to_dict()).eval.sets[0]
    assert again == held


def test_a_set_takes_its_own_data_reward_k_and_temperature():
    spec = validate_spec({**GOOD, "eval": {"sets": [{
        "name": "chain-hard", "dataset": "gen:chain?max_terms=6", "size": 50, "prompts": 20, "n": 16, "k": 4,
        "temperature": 0.6, "reward": {"components": [{"function": "numeric_match", "weight": 1.0}]}}]}})
    one = spec.eval.sets[0]
    assert one.k == [4] and one.reward.function == "sum" and one.temperature == 0.6


@pytest.mark.parametrize("bad,field,words", [
    ({"name": "a", "n": 4, "k": [1, 8]}, "eval.sets.0.k", "1 <= k <= n"),
    ({"name": "a", "n": 4, "k": 0}, "eval.sets.0.k", "not 0"),
    ({"name": "a", "n": 4, "k": [2, 2]}, "eval.sets.0.k", "each k once"),
    ({"name": "a", "n": 4, "temperature": 0}, "eval.sets.0.temperature", "identical samples"),
    ({"name": "a", "n": 0}, "eval.sets.0.n", "greater than or equal to 1"),
    ({"name": "a", "n": 300}, "eval.sets.0.n", "less than or equal to 256"),
    ({"name": "accuracy"}, "eval.sets.0.name", "taken by eval/accuracy"),
    ({"name": "a/b"}, "eval.sets.0.name", "pattern"),
    ({"name": "a", "dataset": "gen:nope"}, "eval.sets.0.dataset", "unknown generator"),
    ({"name": "a", "dataset": "gen:add?max_digits=1000"}, "eval.sets.0.dataset", "max_digits"),
    ({"name": "a", "reward": {"function": "user"}}, "eval.sets.0.reward", "needs reward.code"),
    ({"name": "a", "reward": {"function": "model", "model": {"path": "builtin:tiny-rm"}}}, "eval.sets.0.reward",
     "not supported in an evaluation set"),
    ({"name": "a", "samples": 3}, "eval.sets.0.samples", "unknown field"),
])
def test_a_bad_set_is_refused_naming_its_field(bad, field, words):
    errors = refused([bad])
    assert any(e["field"] == field and words in e["message"] for e in errors), errors


def test_two_sets_may_not_share_a_name():
    errors = refused([{"name": "a"}, {"name": "b"}, {"name": "a"}])
    assert errors == [{"field": "eval.sets", "message": "Value error, sets 0 and 2 are both named 'a'"}]


def test_a_set_of_the_held_out_split_needs_one():
    with pytest.raises(SpecError, match=r"eval.sets.1 \(held\) has no dataset.*task.eval_size is 0"):
        validate_spec({**GOOD, "task": {"dataset": "gen:add", "eval_size": 0},
                       "eval": {"sets": [{"name": "gen", "dataset": "gen:add"}, {"name": "held"}]}})
    validate_spec({**GOOD, "task": {"dataset": "gen:add", "eval_size": 0}, "eval": {"sets": [{"name": "gen", "dataset": "gen:add"}]}})
