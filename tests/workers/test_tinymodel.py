"""The warm start's learning-rate schedule: planned over `schedule_steps`, stopped at
`steps` (the default recipe stops while the model is still learning carries)."""
import pytest

from workers.tinymodel import DEFAULT_RECIPE, sft_lr_factor


def test_sft_rate_warms_up_then_follows_the_planned_cosine_down_to_its_floor():
    recipe = {"steps": 4, "schedule_steps": 40, "final_lr_ratio": 0.1}  # warm-up: 40 // 20 = 2 steps
    assert sft_lr_factor(0, recipe) == 0.5
    assert sft_lr_factor(1, recipe) == pytest.approx(0.5 * (1 + 0.9969173337331280))  # cos(pi / 40)
    assert sft_lr_factor(20, recipe) == pytest.approx(0.5)
    assert sft_lr_factor(40, recipe) == 0.1 and sft_lr_factor(50, recipe) == 0.1


def test_without_a_planned_length_the_schedule_spans_the_steps_run():
    assert sft_lr_factor(20, {"steps": 40, "final_lr_ratio": 0.0}) == pytest.approx(0.5)
    assert sft_lr_factor(40, {"steps": 40}) == 0.0


def test_default_warm_start_stops_at_two_thirds_of_its_peak_rate():
    last = DEFAULT_RECIPE["steps"] - 1
    assert DEFAULT_RECIPE["steps"] < DEFAULT_RECIPE["schedule_steps"]
    assert sft_lr_factor(last, DEFAULT_RECIPE) == pytest.approx(0.655006, abs=1e-6)
