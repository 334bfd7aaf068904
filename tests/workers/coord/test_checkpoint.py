"""Checkpoint files (workers/io/checkpoint.py): the layout, atomic publication, keeping the
last two, cutting metrics.jsonl back on resume, and the data position the controller
saves. The last test restores a real DeepSpeed trainer (no vLLM)."""
import json
import random

import pytest

from workers.io.checkpoint import latest_checkpoint, list_checkpoints, read_metrics, save_checkpoint, truncate_metrics
from workers.coord.controller import Controller
from workers.io.report import PlatformClient, Reporter
from workers.spec import validate_spec


def writer(payload="x"):
    def write(folder):
        (folder / "trainer").mkdir()
        (folder / "trainer" / "weights.bin").write_text(payload)
        (folder / "state.pt").write_text(payload)

    return write


def test_a_checkpoint_is_a_step_folder_with_its_files_and_meta(tmp_path):
    info = save_checkpoint(tmp_path, 4, writer("w4"), {"version": 4, "weights_sha256": "abc"})
    assert info.path == tmp_path / "checkpoints" / "step-4" and (info.step, info.version) == (4, 4)
    assert sorted(p.name for p in info.path.iterdir()) == ["meta.json", "state.pt", "trainer"]
    meta = json.loads((info.path / "meta.json").read_text())
    assert meta["step"] == 4 and meta["version"] == 4 and meta["weights_sha256"] == "abc" and meta["saved_at"] > 0
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-4"]  # no temporary folder left
    assert latest_checkpoint(tmp_path).step == 4


def test_a_save_that_fails_midway_publishes_nothing_and_keeps_the_previous_one(tmp_path):
    save_checkpoint(tmp_path, 2, writer(), {"version": 2})

    def broken(folder):
        (folder / "state.pt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 4, broken, {"version": 4})
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-2"]
    assert latest_checkpoint(tmp_path).step == 2


def test_leftovers_of_a_killed_save_are_ignored_then_cleaned_up(tmp_path):
    root = tmp_path / "checkpoints"
    save_checkpoint(tmp_path, 2, writer(), {"version": 2})
    (root / ".tmp-step-4-999").mkdir()  # a process killed while writing
    (root / ".tmp-step-4-999" / "state.pt").write_text("partial")
    (root / "step-6").mkdir()  # a folder without meta.json is not a checkpoint
    assert [c.step for c in list_checkpoints(tmp_path)] == [2]
    save_checkpoint(tmp_path, 4, writer(), {"version": 4})
    assert not list(root.glob(".tmp-*"))
    assert latest_checkpoint(tmp_path).step == 4


def test_only_the_last_two_checkpoints_are_kept(tmp_path):
    for step in (2, 4, 6, 8, 10):
        save_checkpoint(tmp_path, step, writer(f"w{step}"), {"version": step})
    assert [c.step for c in list_checkpoints(tmp_path)] == [8, 10]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-10", "step-8"]
    assert (tmp_path / "checkpoints" / "step-10" / "state.pt").read_text() == "w10"


def test_saving_the_same_step_again_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 4, writer("first"), {"version": 4})
    save_checkpoint(tmp_path, 4, writer("second"), {"version": 4})
    assert [c.step for c in list_checkpoints(tmp_path)] == [4]
    assert (tmp_path / "checkpoints" / "step-4" / "state.pt").read_text() == "second"


def test_no_checkpoint_folder_means_no_checkpoint(tmp_path):
    assert latest_checkpoint(tmp_path) is None and list_checkpoints(tmp_path / "nowhere") == []


def test_resume_cuts_metrics_after_the_checkpoint_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    points = [{"key": k, "step": s, "value": 1.0, "time": 0.0} for s in range(0, 6) for k in ("a", "b")]
    path.write_text("".join(json.dumps(p) + "\n" for p in points) + '{"key": "a", "st')  # killed mid-line
    assert truncate_metrics(path, 3) == 5
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(p["key"], p["step"]) for p in kept] == [(k, s) for s in range(0, 4) for k in ("a", "b")]
    assert truncate_metrics(path, -1) == 8 and path.read_text() == ""
    assert truncate_metrics(tmp_path / "none.jsonl", 3) == 0


def test_a_resumed_run_sends_the_kept_points_again_before_new_ones_without_rewriting_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"key": "a", "step": s, "value": s, "time": 0.0}) + "\n" for s in range(3)))
    platform = PlatformClient("http://127.0.0.1:9", "flxr_test", 1, timeout=1)
    reporter = Reporter(path, platform, flush_every_s=60, close_timeout_s=0)
    reporter.log(3, {"a": 3})
    reporter.resend(read_metrics(path)[:3])
    assert [p["step"] for p in reporter._points] == [0, 1, 2, 3]
    reporter._stop.set()
    reporter.close()
    assert [p["step"] for p in read_metrics(path)] == [0, 1, 2, 3]


def _controller(tmp_path, seed=3):
    spec = validate_spec({"name": "rows", "model": {"path": "x"}, "task": {"dataset": "gen:add"}, "seed": seed})
    c = Controller(spec, tmp_path, progress=False)
    c.data.rows = [{"prompt": str(i)} for i in range(7)]
    return c


def test_the_data_position_restores_the_same_row_sequence(tmp_path):
    a = _controller(tmp_path)
    rows = a.data.draw()
    drawn = [next(rows)["prompt"] for _ in range(10)]  # into the second epoch
    in_flight = drawn[-3:]  # drawn, not trained on when the checkpoint is taken
    saved = (list(a.data.order), a.data.pos, a.data.rng.getstate())
    expected = [next(rows)["prompt"] for _ in range(12)]

    b = _controller(tmp_path)
    b.data.order, b.data.pos = saved[0], saved[1]
    b.data.rng.setstate(saved[2])
    b.data.redo.extend({"prompt": p} for p in in_flight)
    rows_b = b.data.draw()
    assert [next(rows_b)["prompt"] for _ in range(15)] == in_flight + expected
    assert sorted(drawn[:7]) == sorted(str(i) for i in range(7))  # an epoch is a permutation


@pytest.mark.engine
@pytest.mark.timeout(300)
def test_the_trainer_state_restores_exactly(tmp_path, tiny_model_path):
    """Weights and optimiser state: the step after a restore equals the step without one."""
    from workers.train.trainer import Trainer
    from workers.train.samples import TrainSample

    spec = validate_spec({"name": "t", "model": {"path": tiny_model_path}, "task": {"dataset": "gen:add"},
                          "algorithm": {"lr": 1e-3}})

    def batch(seed):
        r = random.Random(seed)
        return [TrainSample([1, 5, 6, 7], [r.randrange(3, 12) for _ in range(6)], [-1.0] * 6, r.uniform(-1, 1))
                for _ in range(8)]

    a = Trainer(spec, tiny_model_path, 1)
    a.train_step(batch(1))
    a.save_state(str(tmp_path / "trainer"))
    a.train_step(batch(2))
    b = Trainer(spec, tiny_model_path, 1)
    assert b.load_state(str(tmp_path / "trainer")) == 1
    b.train_step(batch(2))
    wa, wb = a.state_dict(), b.state_dict()
    assert b.version == 2 and all(bool((wa[k] == wb[k]).all()) for k in wa)


def test_trainer_shards_are_named_as_deepspeed_names_them_per_rank_and_stage():
    from workers.io.checkpoint import trainer_shards

    assert trainer_shards(2, 0) == ["mp_rank_00_model_states.pt"]
    assert trainer_shards(2, 2) == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                    "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert trainer_shards(2, 3, bf16=True) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def test_a_checkpoint_missing_another_nodes_shards_is_refused_naming_them(tmp_path):
    from workers.io.checkpoint import IncompleteCheckpoint, missing_trainer_shards, require_trainer_shards

    ds = tmp_path / "trainer" / "ds"
    ds.mkdir(parents=True)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 "zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        (ds / name).write_bytes(b"x")
    require_trainer_shards(tmp_path / "trainer", 2, 2)  # node 0 sees both ranks' shards: complete
    assert missing_trainer_shards(tmp_path / "trainer", 4, 2) == [
        "zero_pp_rank_2_mp_rank_00_optim_states.pt", "zero_pp_rank_3_mp_rank_00_optim_states.pt"]
    with pytest.raises(IncompleteCheckpoint, match="lacks 2 of the 4 trainer ranks'.*storage every node shares"):
        require_trainer_shards(tmp_path / "trainer", 4, 2)
