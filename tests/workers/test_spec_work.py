"""A run's total work (the most tokens it can generate: training, each evaluation set,
every evaluation) computed from its spec to the exact token, and the absolute caps the
spec itself puts on max_tokens, max_minutes and the evaluation's timeout."""
import pytest

from workers.spec import MAX_RUN_MINUTES, MAX_TOKENS, SpecError, run_work, validate_spec

GOOD = {"name": "t", "model": {"path": "m"}, "task": {"dataset": "gen:add", "eval_size": 50}}


def spec(**sections):
    return validate_spec({**GOOD, **sections})


def test_a_runs_work_is_training_plus_every_evaluations_sets_to_the_token():
    work = run_work(spec(
        rollout={"max_tokens": 64}, algorithm={"group_size": 8}, schedule={"batch_prompts": 8},
        stop={"max_steps": 200}, eval={"every_steps": 20, "prompts": 200, "samples": 2, "sets": [
            {"name": "a", "prompts": 30, "n": 4},  # the run's 50 held-out rows: 30 of them
            {"name": "b", "dataset": "gen:add", "size": 10, "prompts": 100, "n": 2}]}))  # 10 rows generated
    assert work.training == 200 * 8 * 8 * 64 == 819_200
    # before step 0, at steps 20, 40, ..., 180 (not 200: the evaluation after the last step is that one)
    assert work.evaluations == 1 + 9 + 1
    assert work.greedy == 50 * (1 + 2) * 64 == 9_600  # eval.prompts 200, but only 50 rows are held out
    assert work.sets == (30 * 4 * 64, 10 * 2 * 64) == (7_680, 1_280)
    assert work.per_evaluation == 18_560
    assert work.evaluation_total == 18_560 * 11 == 204_160
    assert work.total == 819_200 + 204_160


def test_evaluations_are_before_and_after_alone_with_every_steps_0_and_count_the_last_step_once():
    assert run_work(spec(eval={"every_steps": 0}, stop={"max_steps": 7})).evaluations == 2
    assert run_work(spec(eval={"every_steps": 5}, stop={"max_steps": 10})).evaluations == 3  # 0, 5, after 10
    assert run_work(spec(eval={"every_steps": 5}, stop={"max_steps": 11})).evaluations == 4  # 0, 5, 10, after 11
    assert run_work(spec(eval={"prompts": 0}, task={"dataset": "gen:add", "eval_size": 0})).per_evaluation == 0


def test_the_largest_spec_the_fields_allow_is_counted_not_overflowed():
    sets = [{"name": f"s{i}", "dataset": "gen:add", "size": 100_000, "prompts": 100_000, "n": 256}
            for i in range(16)]
    work = run_work(spec(rollout={"max_tokens": MAX_TOKENS}, eval={"sets": sets, "every_steps": 1},
                         stop={"max_steps": 1000}))
    assert work.sets[0] == 100_000 * 256 * 262_144
    assert work.evaluation_total == 16 * 100_000 * 256 * 262_144 * (2 + 999) + work.greedy * 1001


@pytest.mark.parametrize("section, field, value, message", [
    ({"rollout": {"max_tokens": 1_000_000}}, "rollout.max_tokens", 1_000_000, "less than or equal to 262144"),
    ({"stop": {"max_minutes": 1e9}}, "stop.max_minutes", 1e9, "less than or equal to 43200"),
    ({"eval": {"timeout_minutes": 1e9}}, "eval.timeout_minutes", 1e9, "less than or equal to 43200"),
    ({"eval": {"timeout_minutes": 0}}, "eval.timeout_minutes", 0, "greater than 0"),
])
def test_absolute_caps_refuse_by_field(section, field, value, message):
    with pytest.raises(SpecError) as err:
        spec(**section)
    assert err.value.errors[0]["field"] == field and message in err.value.errors[0]["message"]


def test_the_caps_themselves_are_accepted_and_the_eval_timeout_has_a_default():
    s = spec(rollout={"max_tokens": MAX_TOKENS}, stop={"max_minutes": MAX_RUN_MINUTES},
             eval={"timeout_minutes": MAX_RUN_MINUTES})
    assert (s.rollout.max_tokens, s.stop.max_minutes, MAX_RUN_MINUTES) == (262_144, 43_200, 30 * 24 * 60)
    assert spec().eval.timeout_minutes == 60
