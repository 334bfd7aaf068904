"""Each step's wall time split into parts along the trainer's critical path (exact
numbers, a fake clock), and the same split in a real run on the tiny model."""
import asyncio
import json

import pytest

from workers.coord.time_breakdown import PARTS, TimeBreakdown, metric, summarize


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def at(self, t: float) -> None:
        self.now = 100.0 + t


def parts(out: dict) -> dict:
    return {p: out[metric(p)] for p in PARTS if out[metric(p)]}


def test_a_sync_step_adds_up_generation_the_scoring_tail_training_and_the_update():
    clock = Clock()
    times = TimeBreakdown(clock)
    times.restart()
    clock.at(0.5)
    times.engine_busy(True)  # 0.5 s of dispatch before the first request: idle
    clock.at(1.0)
    times.begin("scoring")  # fused scoring beside generation: still generation's time
    clock.at(1.5)
    times.end("scoring")
    clock.at(4.0)
    times.begin("scoring")  # the last sample's scoring outlives generation
    times.engine_busy(False)
    clock.at(4.25)
    times.end("scoring")
    times.begin("train")
    clock.at(7.25)
    times.end("train")
    times.begin("weight_update")
    clock.at(7.75)
    times.end("weight_update")
    out = times.step({"trainer/backward_s": 1.5, "trainer/optimizer_s": 0.5})
    assert parts(out) == {"idle": 0.5, "generation": 3.5, "scoring": 0.25, "forward": 1.0, "backward": 1.5,
                          "optimizer": 0.5, "weight_update": 0.5}
    assert out["time/step_s"] == 7.75 == sum(out[metric(p)] for p in PARTS)


def test_async_generation_beside_the_trainer_counts_as_training_and_only_the_wait_as_generation():
    clock = Clock()
    times = TimeBreakdown(clock)
    times.restart()
    times.engine_busy(True)  # two engines
    times.engine_busy(True)
    clock.at(1.0)
    times.begin("train")  # the trainer steps while both engines keep generating
    clock.at(3.0)
    times.engine_busy(False)
    clock.at(4.0)
    times.end("train")
    times.begin("weight_update")
    clock.at(4.5)
    times.end("weight_update")
    first = times.step({})  # no split reported: all of the trainer's time is forward
    assert parts(first) == {"generation": 1.0, "forward": 3.0, "weight_update": 0.5}
    clock.at(6.0)  # the second engine still generates: the trainer waits on it
    times.engine_busy(False)
    clock.at(6.5)
    second = times.step({})
    assert parts(second) == {"generation": 1.5, "idle": 0.5} and second["time/step_s"] == 2.0


def test_time_with_admission_held_by_the_gate_and_nothing_running_is_gate_wait():
    clock = Clock()
    blocked = {"now": True}
    times = TimeBreakdown(clock, gate_blocked=lambda: blocked["now"])
    times.restart()
    clock.at(2.0)
    blocked["now"] = False  # the gate opens: the change is seen at the next event
    times.engine_busy(True)
    clock.at(3.0)
    times.engine_busy(False)
    clock.at(3.5)
    assert parts(times.step({})) == {"gate_wait": 2.0, "generation": 1.0, "idle": 0.5}


def test_evaluation_between_steps_is_its_own_part_and_outranks_its_generation():
    clock = Clock()
    times = TimeBreakdown(clock)
    times.restart()
    with times.track("eval"):
        times.engine_busy(True)
        clock.at(2.0)
        times.engine_busy(False)
    clock.at(2.5)
    assert parts(times.step({})) == {"eval": 2.0, "idle": 0.5}


def test_the_trainer_split_never_exceeds_the_trainer_time_and_time_before_restart_is_dropped():
    clock = Clock()
    times = TimeBreakdown(clock)
    clock.at(10.0)  # set-up and the first evaluation: not a step's
    times.restart()
    times.begin("train")
    clock.at(12.0)
    times.end("train")
    out = times.step({"trainer/backward_s": 1.5, "trainer/optimizer_s": 1.0})
    assert parts(out) == {"backward": 1.5, "optimizer": 0.5} and out["time/step_s"] == 2.0


def test_an_end_without_its_begin_is_ignored():
    clock = Clock()
    times = TimeBreakdown(clock)
    times.engine_busy(False)  # a request that ran before the engines were watched
    times.restart()
    clock.at(1.0)
    assert parts(times.step({})) == {"idle": 1.0}


def test_summarize_gives_mean_seconds_and_shares_per_step():
    steps = [{"time/step_s": 2.0, "time/generation_s": 1.0, "time/backward_s": 1.0},
             {"time/step_s": 4.0, "time/generation_s": 3.0, "time/backward_s": 1.0}]
    out = summarize(steps)
    assert out["step_s"] == 3.0 and out["generation_s"] == 2.0 and out["backward_s"] == 1.0
    assert out["generation_share"] == pytest.approx(2 / 3) and out["idle_share"] == 0.0
    assert summarize([]) == {}


@pytest.mark.engine
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.slow), "async"])  # sync runs: test_sync_run.py
def test_every_step_of_a_real_run_reports_parts_that_add_up_to_its_wall_time(mode, tmp_path, tiny_model_path):
    from workers.coord.controller import Controller
    from workers.spec import validate_spec

    spec = validate_spec({"name": f"times-{mode}", "model": {"path": tiny_model_path},
                          "task": {"dataset": "gen:add", "size": 64, "eval_size": 4},
                          "algorithm": {"group_size": 2}, "rollout": {"max_tokens": 8},
                          "schedule": {"mode": mode, "batch_prompts": 2},
                          "eval": {"prompts": 4, "every_steps": 0}, "stop": {"max_steps": 3, "max_minutes": 5}})
    result = asyncio.run(Controller(spec, tmp_path, progress=False).run())
    assert result.steps == 3
    by_step: dict[int, dict] = {}
    for point in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()):
        if point["key"].startswith("time/"):
            by_step.setdefault(point["step"], {})[point["key"]] = point["value"]
    assert sorted(by_step) == [1, 2, 3]
    wall = 0.0
    for values in by_step.values():
        assert sum(values[metric(p)] for p in PARTS) == pytest.approx(values["time/step_s"], abs=1e-9)
        assert values["time/backward_s"] > 0 and values["time/optimizer_s"] > 0 and values["time/weight_update_s"] > 0
        wall += values["time/step_s"]
    assert wall == pytest.approx(result.seconds, rel=0.05)  # the steps cover the run's wall time
    # the first step waits for its rollouts in both modes; a sync step always does, while an
    # async step may find its batch ready (generation beside the previous step is training's)
    waited = [by_step[s]["time/generation_s"] for s in (1, 2, 3)]
    assert waited[0] > 0 and (mode == "async" or min(waited) > 0)
