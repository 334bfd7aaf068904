"""The Controller hands its parts the data and the parts they use, never itself: no part
of a run holds the Controller, and the parts' state is read on the parts themselves."""
from workers.coord.controller import Controller
from workers.spec import validate_spec


def _controller(tmp_path):
    spec = validate_spec({"name": "parts", "model": {"path": "x"}, "task": {"dataset": "gen:add"}})
    return Controller(spec, tmp_path, progress=False)


def test_no_part_of_a_run_holds_the_controller(tmp_path):
    c = _controller(tmp_path)
    parts = {"checkpoints": c.checkpoints, "checkpoint parts": c.checkpoints.run, "metrics": c.metrics,
             "evaluation": c.evaluation, "work": c.work, "data": c.data, "fleet": c.fleet, "tail": c.fleet.tail,
             "weights": c.fleet.weights, "roles": c.fleet.roles, "processes": c.processes}
    holding = [f"{name}.{attr}" for name, part in parts.items() for attr, value in vars(part).items() if value is c]
    assert holding == []


def test_the_parts_share_one_state_each(tmp_path):
    """One result, one reporter, one trainer work and one RNG, as each part sees them."""
    c = _controller(tmp_path)
    assert c.metrics.result is c.result is c.checkpoints.run.result
    assert c.metrics.reporter is c.reporter is c.evaluation.reporter
    assert c.metrics.work is c.work is c.checkpoints.run.work
    assert c.fleet._rng is c.data.rng  # dispatch and the row order: one RNG state in a checkpoint
    assert not any(hasattr(c, name) for name in ("engines", "trainer", "broadcaster", "prompts", "rewards"))
