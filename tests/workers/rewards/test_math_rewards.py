"""Math answer extraction, format rewards and weighted sums of reward components."""
import inspect
from fractions import Fraction

import pytest

import workers.tasks.builtin_rewards
from workers.rewards.service import RewardFunctionBroken, RewardService
from workers.tasks.builtin_rewards import (BUILTIN_REWARDS, extract_answer, format_boxed, format_check, format_gsm8k, format_regex,
                             math_answer, normalize_answer, reference_answer)
from workers.rewards.sandbox import try_reward
from workers.spec import RewardSpec, SpecError, validate_spec

GOOD = {"name": "t", "model": {"path": "m"}, "task": {"dataset": "gen:add"}}
GSM8K_SOLUTION = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                  "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


# --- extraction ------------------------------------------------------------------------------


@pytest.mark.parametrize("text, answer", [
    (r"so the answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),          # nested braces kept whole
    (r"\boxed{\left(3, \frac{1}{2}\right)}", r"\left(3, \frac{1}{2}\right)"),
    (r"first \boxed{3}, then on reflection \boxed{4}", "4"),               # the last box wins
    (r"The answer is \boxed 5.", "5."),
    (r"\boxed{12} beats #### 7 and 9", "12"),                              # a box beats '####' and numbers
    ("She has 3 apples.\n#### 1,234\n", "1,234"),                           # '####' beats the last number
    ("so\n#### 72 clips\nmaybe 5", "72"),                                   # a '####' line's first number
    ("2 + 3 = 5, then 5 * 2 = 10.", "10"),                                  # else the last number
    ("half: 1/2", "1/2"),
    ("it costs $1,234.50 in total", "1,234.50"),
    ("no number here", None),
    ("", None),
    (r"empty box \boxed{} after 3", None),                                  # the model boxed nothing
    (r"truncated \boxed{4", "4"),                                           # an unclosed box is no box
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_reference_answer_reads_a_full_solution_or_takes_a_bare_answer_whole():
    assert reference_answer(GSM8K_SOLUTION) == "72"
    assert reference_answer(r"... so $x = \boxed{\frac{3}{4}}$") == r"\frac{3}{4}"
    assert reference_answer("72") == "72" and reference_answer(72) == "72"
    assert reference_answer(r"\frac{1}{2}") == r"\frac{1}{2}"  # not its last number, 2
    assert reference_answer("(3, -1)") == "(3, -1)"
    assert reference_answer("") is None and reference_answer(None) is None


@pytest.mark.parametrize("raw, value", [
    ("3", Fraction(3)), ("3.0", Fraction(3)), ("3.", Fraction(3)), ("$5.00", Fraction(5)), (r"\$5", Fraction(5)),
    ("1,234", Fraction(1234)), ("-1,234,567.5", Fraction(-2469135, 2)), ("50%", Fraction(50)), (r"50\%", Fraction(50)),
    ("3/4", Fraction(3, 4)), ("-3/4", Fraction(-3, 4)), (r"\frac{1}{2}", Fraction(1, 2)), (r"\dfrac{3}{4}", Fraction(3, 4)),
    (r"-\frac{1}{2}", Fraction(-1, 2)), (r"\frac12", Fraction(1, 2)), (".5", Fraction(1, 2)), ("x = 5", Fraction(5)),
    (r"\text{5}", Fraction(5)), (r"90^\circ", Fraction(90)), ("\u22127", Fraction(-7)),
    ("1/0", "1/0"), (r"\left( 3, -1 \right)", "(3,-1)"), (" x^2 + 1 ", "x^2+1"), ("1,2", "1,2"),
])
def test_normalize_answer(raw, value):
    got = normalize_answer(raw)
    assert got == value and type(got) is type(value)


def test_normalize_answer_survives_a_number_too_long_for_int():
    assert normalize_answer("9" * 5000) == "9" * 5000  # past Python's int-digits limit: compared as text


# --- math_answer -----------------------------------------------------------------------------


@pytest.mark.parametrize("completion, answer, reward", [
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{1/2}", r"\dfrac{1}{2}", 1.0),
    ("The total is $5.00", "5", 1.0),
    ("#### 1,234", "1234", 1.0),
    ("3.0", "3", 1.0),
    (r"\boxed{3} wait, no: \boxed{4}", "4", 1.0),
    (r"\boxed{4} wait, no: \boxed{3}", "4", 0.0),
    ("no number at all", "3", 0.0),
    ("", "3", 0.0),
    ("The answer is 72", GSM8K_SOLUTION, 1.0),                  # a GSM8K answer field as the reference
    ("Natalia sold 24 in May, so 72 in all.\n#### 72", GSM8K_SOLUTION, 1.0),
    ("so 71", GSM8K_SOLUTION, 0.0),
    (r"\boxed{(3, -1)}", "(3,-1)", 1.0),                         # text compared without whitespace
    (r"\boxed{\text{(C)}}", "(C)", 1.0),
    (r"\boxed{x^2+1}", "x^2 + 2", 0.0),
    ("7", "", 0.0),                                              # no reference: nothing matches
])
def test_math_answer(completion, answer, reward):
    assert math_answer("Q", completion, answer=answer) == reward


def test_math_answer_is_registered_with_the_format_rewards():
    assert {"math_answer", "format_boxed", "format_gsm8k", "format_regex"} <= set(BUILTIN_REWARDS)
    assert all(inspect.getdoc(fn) for fn in BUILTIN_REWARDS.values())  # the platform's catalog shows them


def test_builtins_still_run_from_source_in_the_sandbox():
    """The platform tries a built-in by running this module's source in the sandbox."""
    code = inspect.getsource(workers.tasks.builtin_rewards) + "\nreward = math_answer\n"
    rows = [{"prompt": "Q", "completion": r"\boxed{\frac{1}{2}}", "fields": {"answer": "0.5"}},
            {"prompt": "Q", "completion": "#### 7", "fields": {"answer": GSM8K_SOLUTION}}]
    out = try_reward(code, rows)
    assert out["ok"] and [r["reward"] for r in out["results"]] == [1.0, 0.0]


# --- format rewards --------------------------------------------------------------------------


def test_format_rewards():
    assert format_boxed("", r"so \boxed{\frac{1}{2}}") == 1.0
    assert format_boxed("", r"\boxed 5") == 1.0
    assert format_boxed("", r"\boxed{}") == 0.0 and format_boxed("", r"\boxed{5") == 0.0 and format_boxed("", "5") == 0.0
    assert format_gsm8k("", "work\n#### 1,234") == 1.0
    assert format_gsm8k("", "work\n#### 72 clips") == 1.0
    assert format_gsm8k("", "#### five") == 0.0 and format_gsm8k("", "the answer: 5 ####") == 0.0
    assert format_regex("", "<think>a</think> 5", pattern=r"</think>\s*\d") == 1.0
    assert format_regex("", "5", pattern=r"</think>") == 0.0
    with pytest.raises(ValueError, match="needs a pattern"):
        format_regex("", "5")
    assert format_check("", "12 -3") == 1.0 and format_check("", "x", pattern="[a-z]") == 1.0


# --- reward.components in the spec -----------------------------------------------------------


def _errors(reward: dict) -> list[dict]:
    with pytest.raises(SpecError) as err:
        validate_spec({**GOOD, "reward": reward})
    return err.value.errors


def test_components_make_function_sum_and_old_specs_are_unchanged():
    old = validate_spec({**GOOD, "reward": {"function": "numeric_match"}}).reward
    assert old.function == "numeric_match" and old.components is None
    assert validate_spec(GOOD).reward.function == "numeric_match"
    spec = validate_spec({**GOOD, "reward": {"components": [
        {"function": "math_answer", "weight": 0.9},
        {"function": "format_check", "weight": 0.1, "params": {"pattern": r".*\\boxed\{.+\}.*"}, "name": "boxed"}]}})
    assert spec.reward.function == "sum"
    assert [(c.function, c.weight, c.params, c.name) for c in spec.reward.components] == [
        ("math_answer", 0.9, {}, None), ("format_check", 0.1, {"pattern": r".*\\boxed\{.+\}.*"}, "boxed")]
    again = validate_spec(spec.to_dict()).reward  # a stored spec validates again unchanged
    assert again == spec.reward
    assert validate_spec({**GOOD, "reward": {"function": "sum", "components": [{"function": "math_answer"}]}}) \
        .reward.components[0].weight == 1.0


@pytest.mark.parametrize("reward, field, message", [
    ({"components": [{"function": "math_answer"}, {"function": "foo"}]},
     "reward.components.1.function", "unknown built-in 'foo'"),
    ({"components": [{"function": "mine@2"}]}, "reward.components.0.function", "team functions cannot be components"),
    ({"components": [{"weight": 1}]}, "reward.components.0.function", "Field required"),
    ({"components": [{"function": "format_check", "params": {"patern": "x"}}]},
     "reward.components.0.params", "format_check takes no parameter 'patern' (it takes: pattern)"),
    ({"components": [{"function": "format_check", "params": {"pattern": "("}}]},
     "reward.components.0.params", "pattern is not a regular expression"),
    ({"components": [{"function": "math_answer", "params": {"completion": "x"}}]},
     "reward.components.0.params", "completion: supplied by the sample"),
    ({"components": [{"function": "math_answer", "weight": "heavy"}]}, "reward.components.0.weight", "valid number"),
    ({"components": [{"function": "math_answer", "weight": float("inf")}]}, "reward.components.0.weight", "finite"),
    ({"components": [{"function": "math_answer", "wieght": 1}]}, "reward.components.0.wieght", "unknown field"),
    ({"components": []}, "reward.components", "at least 1 item"),
    ({"function": "numeric_match", "components": [{"function": "math_answer"}]},
     "reward.components", "reward.function must be 'sum' or omitted with components, not 'numeric_match'"),
    ({"function": "user", "code": "x", "components": [{"function": "math_answer"}]},
     "reward.components", "not 'user'"),
    ({"components": [{"function": "user"}]}, "reward.components", "component 0 is 'user' and needs reward.code"),
    ({"code": "x", "components": [{"function": "user"}, {"function": "user", "name": "again"}]},
     "reward.components", "components 0, 1 are all 'user'"),
    ({"code": "x", "components": [{"function": "math_answer"}]}, "reward.components", "no component is 'user'"),
    ({"components": [{"function": "format_check"}, {"function": "format_check", "params": {"pattern": "a"}}]},
     "reward.components", "components 0 and 1 are both named 'format_check'"),
    ({"components": [{"function": "math_answer", "name": "has space"}]}, "reward.components.0.name", "pattern"),
    ({"function": "sum"}, "reward", "reward.function 'sum' needs reward.components"),
])
def test_bad_components_are_reported_by_field(reward, field, message):
    errors = _errors(reward)
    assert [e["field"] for e in errors] == [field]
    assert message in errors[0]["message"]


# --- the reward service ----------------------------------------------------------------------


def _service(components: list[dict], **spec) -> RewardService:
    return RewardService(RewardSpec(components=components, **spec))


def test_weighted_sum_of_components():
    service = _service([{"function": "math_answer", "weight": 0.9}, {"function": "format_boxed", "weight": 0.1}])
    right_boxed = service.score_sync("Q", r"so \boxed{72}", {"answer": GSM8K_SOLUTION})
    assert right_boxed.reward == pytest.approx(1.0) and right_boxed.error is None
    assert right_boxed.parts == {"math_answer": 1.0, "format_boxed": 1.0}
    right_bare = service.score_sync("Q", "so 72", {"answer": GSM8K_SOLUTION})
    assert right_bare.reward == pytest.approx(0.9) and right_bare.parts == {"math_answer": 1.0, "format_boxed": 0.0}
    wrong_boxed = service.score_sync("Q", r"\boxed{71}", {"answer": "72"})
    assert wrong_boxed.reward == pytest.approx(0.1)
    assert service.score_sync("Q", "no idea", {"answer": "72"}).reward == 0.0
    assert service.part_means() == pytest.approx({"math_answer": 0.5, "format_boxed": 0.5})


def test_negative_weights_and_params_override_row_fields():
    service = _service([
        {"function": "numeric_match", "weight": 1.0},
        {"function": "format_check", "weight": -0.5, "params": {"pattern": "[0-9]+"}, "name": "not_digits_only"},
        {"function": "length_penalty", "weight": 0.0, "params": {"target_chars": 1}},
    ])
    # the row's own 'pattern' (a letter) loses to the component's params
    score = service.score_sync("Q", "12", {"answer": "12", "pattern": "[a-z]"})
    assert score.reward == pytest.approx(0.5)
    assert score.parts == pytest.approx({"numeric_match": 1.0, "not_digits_only": 1.0, "length_penalty": 0.99})


def test_a_failing_component_scores_zero_and_marks_the_sample():
    service = _service([{"function": "math_answer", "weight": 0.9}, {"function": "format_regex", "weight": 0.1}])
    service.fail_fast_after = 2
    score = service.score_sync("Q", r"\boxed{3}", {"answer": "3"})
    assert score.reward == pytest.approx(0.9)
    assert score.parts == {"math_answer": 1.0, "format_regex": 0.0}
    assert score.error == "format_regex: ValueError: format_regex needs a pattern: give it in the component's params"
    with pytest.raises(RewardFunctionBroken, match="format_regex: ValueError"):  # broken on every sample: stop
        service.score_sync("Q", "4", {"answer": "3"})


def test_user_code_as_one_component():
    code = "def reward(prompt, completion, answer='', bonus=0.0, **f):\n    return float(len(completion) < 10) + bonus"
    service = _service([{"function": "math_answer", "weight": 0.8},
                        {"function": "user", "weight": 0.2, "params": {"bonus": 0.5}, "name": "short"}], code=code)
    try:
        score = service.score_sync("Q", r"\boxed{3}", {"answer": "3", "bonus": 9})
        assert score.reward == pytest.approx(0.8 + 0.2 * 1.5) and score.parts == {"math_answer": 1.0, "short": 1.5}
    finally:
        service.close()


def test_single_function_specs_score_as_before():
    service = RewardService(RewardSpec(function="numeric_match"))
    score = service.score_sync("1+2=", "3", {"answer": "3"})
    assert (score.reward, score.error, score.parts) == (1.0, None, {})
    assert service.part_means() == {}
    assert RewardService(RewardSpec(function="math_answer")).score_sync("Q", "#### 1,234", {"answer": "1234"}).reward == 1.0
