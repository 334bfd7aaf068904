"""A trainer that raises fails the run as a failure (exit code 1), whatever it raises:
a ValueError out of the trainer is not "bad input" (exit code 2)."""
import asyncio

import pytest

from workers.coord.controller import Controller, TrainerError
from workers.spec import validate_spec


def test_a_trainer_exception_is_reported_as_a_trainer_failure(tmp_path):
    controller = Controller(validate_spec({"name": "t", "model": {"path": "x"}, "task": {"dataset": "gen:add"}}),
                            tmp_path, progress=False)

    def broken():
        raise ValueError("NaN in the loss")

    with pytest.raises(TrainerError, match="the trainer failed: ValueError: NaN in the loss"):
        asyncio.run(controller.work.run(broken))
    assert not isinstance(TrainerError("x"), ValueError)  # __main__ maps ValueError to exit code 2
