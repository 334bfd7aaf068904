"""The built-in environments: ``tools`` answers every tool call of a turn in one tool message
and ends at a turn without one; ``guess_number`` answers higher/lower, rewards the right
guess, and its feedback lets a searching policy beat its first guess. ``make_environment``
builds each from the spec, and the generators make their rows."""
import asyncio
import json
import os
import random
import time

import pytest

from workers.agents.api import Environment, Observation
from workers.agents.builtin import GuessNumberEnvironment, ToolsEnvironment, make_environment
from workers.agents.sandboxed import SandboxedEnvironment, close_pools
from workers.rewards.sandbox_boundary import UNSAFE_ENV
from workers.spec import EnvironmentSpec
from workers.tasks.datasets import generate, load_rows, tool_arith_prompt


def run(coro):
    return asyncio.run(coro)


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def tools_env(**spec) -> ToolsEnvironment:
    env = make_environment(EnvironmentSpec(name="tools", **spec), model_path="/nonexistent")
    assert isinstance(env, ToolsEnvironment) and isinstance(env, Environment)
    return env


# -- tools -------------------------------------------------------------------------
def test_a_calculator_call_is_answered_with_a_tool_message_and_its_record():
    env = tools_env()
    run(env.reset({"prompt": tool_arith_prompt(347, 29), "answer": "10063"}))
    result = run(env.step("I will use the calculator.\n" + call("calculator", expression="347 * 29"), [1, 2]))
    assert result.observation == Observation("10063", "tool")
    assert not result.done and result.error is None and result.reward == 0.0
    (record,) = result.tools
    assert (record.name, record.arguments, record.output, record.error) == (
        "calculator", {"expression": "347 * 29"}, "10063", None)
    assert record.ms >= 0.0


def test_a_turn_without_a_call_is_the_final_answer():
    env = tools_env()
    run(env.reset({"prompt": "p", "answer": "1"}))
    result = run(env.step("The answer is 10063.", [5]))
    assert result.done and result.observation is None and result.tools == ()


def test_several_calls_and_errors_are_answered_in_one_message_the_model_can_read():
    env = tools_env()
    text = call("calculator", expression="2 + 3") + call("calculator", expression="1 / 0") + call("python", code="1")
    result = run(env.step(text, [1]))
    assert result.observation.content == (
        "[1] calculator: 5\n[2] calculator: error: division by zero\n"
        "[3] python: error: unknown tool 'python'; the tools are: calculator")
    assert [r.error for r in result.tools] == [None, "division by zero", "unknown tool 'python'; the tools are: calculator"]
    assert not result.done


def test_a_malformed_call_is_an_error_observation_and_the_episode_goes_on():
    env = tools_env()
    result = run(env.step('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"\n</tool_call>', [1]))
    assert not result.done and result.observation.role == "tool"
    assert result.observation.content.startswith("error: the tool call is not valid JSON")
    assert result.tools[0].error.startswith("the tool call is not valid JSON")


def test_calls_past_the_per_turn_cap_are_not_run():
    env = tools_env(params={"max_calls": 2})
    result = run(env.step(call("calculator", expression="1") * 3, [1]))
    assert [r.output for r in result.tools] == ["1", "1", "error: at most 2 tool calls a turn; this one was not run"]


@pytest.mark.skipif(os.environ.get(UNSAFE_ENV) == "1", reason="the OS sandbox is switched off")
def test_the_python_tool_runs_in_the_sandbox_with_the_specs_caps_and_a_turns_calls_at_once():
    env = tools_env(tools=["calculator", "python"], timeout_s=2.0, output_chars=50)
    hang = call("python", code="while True: pass")
    started = time.monotonic()
    result = run(env.step(call("python", code="print(sum(range(10)))") + hang + hang, [1]))
    elapsed = time.monotonic() - started
    assert result.observation.content == ("[1] python: 45\n\n[2] python: \n[killed: timed out after 2 s]\n"
                                          "[3] python: \n[killed: timed out after 2 s]")
    assert [r.error for r in result.tools] == [None, "timeout", "timeout"]
    assert result.tools[1].ms >= 2000
    assert elapsed < 3.5  # the two hangs ran side by side, not one after the other


# -- guess_number --------------------------------------------------------------------
def guess_env(secret=37, low=1, high=100) -> GuessNumberEnvironment:
    env = make_environment(EnvironmentSpec(name="guess_number", rewards="turns"), model_path="")
    run(env.reset({"prompt": "guess", "answer": str(secret), "low": low, "high": high}))
    return env


def test_guess_number_answers_higher_lower_and_rewards_the_right_guess():
    env = guess_env(37)
    low = run(env.step("I guess 50", [1]))
    assert low.observation == Observation("50 is wrong: the number is lower than 50.", "user")
    assert (low.reward, low.done) == (0.0, False)
    high = run(env.step("Then 20, or maybe 25", [2]))  # the last integer of the turn is the guess
    assert high.observation.content == "25 is wrong: the number is higher than 25."
    right = run(env.step("37", [3]))
    assert (right.reward, right.done) == (1.0, True)
    assert right.observation.content == "37 is correct."


def test_a_turn_without_a_number_is_asked_for_one():
    result = run(guess_env(5, 1, 10).step("hmm, let me think", [1]))
    assert result.observation == Observation("Please answer with one whole number from 1 to 10.", "user")
    assert (result.reward, result.done) == (0.0, False)


def play(secret: int, policy, turns: int = 7) -> float:
    """The episode's return under ``policy(last_observation, low, high) -> guess``."""
    env, low, high, observation = guess_env(secret), 1, 100, None
    for _ in range(turns):
        guess = policy(observation, low, high)
        result = run(env.step(f"My guess is {guess}.", [guess]))
        if result.done:
            return result.reward
        observation = result.observation.content
        if "higher" in observation:
            low = guess + 1
        else:
            high = guess - 1
    return 0.0


def test_feedback_helps_a_policy_that_uses_it_beats_its_first_guess():
    rows = generate("guess_number", 100, seed=3)
    secrets = [int(r["answer"]) for r in rows]
    rng = random.Random(0)
    first_guess_only = sum(play(s, lambda obs, lo, hi: rng.randint(1, 100), turns=1) for s in secrets)
    searching = sum(play(s, lambda obs, lo, hi: (lo + hi) // 2, turns=7) for s in secrets)
    assert searching == 100.0  # a binary search finds every secret of 1..100 within 7 turns
    assert first_guess_only < 10


# -- the factory ---------------------------------------------------------------------
def test_each_episode_gets_a_fresh_environment():
    spec = EnvironmentSpec(name="guess_number")
    assert make_environment(spec, model_path="") is not make_environment(spec, model_path="")


def test_a_user_environment_is_the_sandboxed_one():
    env = make_environment(EnvironmentSpec(name="user", code="class Environment: pass"), model_path="")
    assert isinstance(env, SandboxedEnvironment)
    close_pools()


@pytest.mark.parametrize("spec, error", [
    (dict(name="maze"), "unknown environment 'maze'; the built-in ones are tools, guess_number"),
    (dict(name="team-env@3"), "is a platform environment: resolve it to its code first"),
    (dict(name="guess_number", params={"colour": "red"}), "task.environment.params for 'guess_number'"),
])
def test_an_environment_that_cannot_be_made_is_named(spec, error):
    with pytest.raises(ValueError, match=error):
        make_environment(EnvironmentSpec(**spec), model_path="")


# -- the generators ------------------------------------------------------------------
def test_tool_arith_rows_are_products_of_the_asked_digit_counts():
    rows = generate("tool_arith", 50, seed=1, digits_a=3, digits_b=2)
    for row in rows:
        assert row["prompt"] == f"What is {row['a']} * {row['b']}?" == tool_arith_prompt(row["a"], row["b"], "*")
        assert 100 <= row["a"] <= 999 and 10 <= row["b"] <= 99
        assert row["answer"] == str(row["a"] * row["b"])
    assert rows == generate("tool_arith", 50, seed=1, digits_a=3, digits_b=2)  # deterministic in the seed


def test_guess_number_rows_hold_a_secret_within_their_bounds():
    train, held_out = load_rows("gen:guess_number?low=1&high=20", size=40, eval_size=5)
    for row in train + held_out:
        assert row["low"] == 1 and row["high"] == 20 and 1 <= int(row["answer"]) <= 20
        assert "I am thinking of a whole number from 1 to 20." in row["prompt"]
    assert len({row["prompt"] for row in train + held_out}) == 45  # held-out prompts stay out of training
