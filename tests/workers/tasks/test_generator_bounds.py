"""Every parameter of every built-in generator (gen:<name>?k=v, the datasets API) is bounded
when the spec is validated, with the parameter and its bound named; so are the rows
(task.size + task.eval_size) and their product with a row's size. At the bounds, a
dataset is generated in seconds."""
import time

import pytest

from workers.spec import SpecError, validate_spec
from workers.tasks.datasets import (
    GENERATOR_PARAMS, GENERATORS, MAX_GENERATED_CHARS, MAX_GENERATED_ROWS, DatasetError, _row_chars, generate, load_rows,
)


def spec_for(dataset: str, **task) -> dict:
    return {"name": "g", "model": {"path": "builtin:tiny"}, "task": {"dataset": dataset, **task}}


def refused(dataset: str, **task) -> dict:
    started = time.monotonic()
    with pytest.raises(SpecError) as error:
        validate_spec(spec_for(dataset, **task))
    assert time.monotonic() - started < 1.0
    return error.value.errors[0]


def test_every_generator_parameter_has_a_bound():
    import inspect

    for name, fn in GENERATORS.items():
        taken = [p for p in inspect.signature(fn).parameters if p not in ("n", "seed")]
        assert sorted(taken) == sorted(GENERATOR_PARAMS[name]), name


@pytest.mark.parametrize("name,param", [(n, p) for n, params in GENERATOR_PARAMS.items() for p in params])
def test_each_parameter_over_or_under_its_bound_is_refused_naming_it(name, param):
    low, high = GENERATOR_PARAMS[name][param]
    for value in (high + 1, low - 1, 10 ** 30, "abc", "1e9"):
        error = refused(f"gen:{name}?{param}={value}")
        assert error["field"] == "task.dataset"
        assert param in error["message"] and f"from {low} to {high}" in error["message"], error


def test_the_issues_parameters_are_refused_at_once():
    assert "from 1 to 100" in refused("gen:add?max_digits=10000000")["message"]
    assert "from 1 to 100" in refused("gen:countdown?numbers=5000000")["message"]


def test_unknown_parameters_and_malformed_queries_are_refused_by_name():
    assert "no parameter 'digits'" in refused("gen:add?digits=3")["message"]
    assert "no parameter 'seed'" in refused("gen:add?seed=3")["message"]
    assert "over 1000 characters" in refused("gen:add?max_digits=" + "1" * 2000)["message"]


def test_the_rows_and_rows_times_their_size_are_bounded():
    error = refused("gen:add", size=10 ** 9)
    assert error["field"] == "task" and f"at most {MAX_GENERATED_ROWS} rows" in error["message"]
    error = refused("gen:countdown?numbers=100", size=150_000)
    assert "numbers=100" in error["message"] and f"the bound is {MAX_GENERATED_CHARS}" in error["message"]
    with pytest.raises(DatasetError, match="numbers must be an integer from 1 to 100"):
        generate("countdown", 10, numbers=10 ** 6)  # the datasets API's path: generate() checks too
    validate_spec(spec_for("data.jsonl", size=10 ** 9))  # a file's rows are what the file has


@pytest.mark.parametrize("name", ["countdown"])  # the slowest a row (its expression grows quadratically)
def test_at_the_bounds_a_dataset_is_generated_in_seconds(name):
    params = {p: high for p, (_, high) in GENERATOR_PARAMS[name].items()}
    rows = min(MAX_GENERATED_ROWS, MAX_GENERATED_CHARS // _row_chars(name, params)) - 200
    dataset = f"gen:{name}?" + "&".join(f"{k}={v}" for k, v in params.items())
    spec = validate_spec(spec_for(dataset, size=rows, eval_size=200))
    started = time.monotonic()
    train, held_out = load_rows(spec.task.dataset, spec.task.size, spec.task.eval_size)
    assert len(held_out) == 200 and train
    assert time.monotonic() - started < 15
