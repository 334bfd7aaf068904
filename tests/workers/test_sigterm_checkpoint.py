"""SIGTERM to `python -m workers run` (a host shutting down, a scheduler pre-empting):
the step in progress finishes, a checkpoint is saved after it although the spec saves
none before the end (checkpoint_every: 0), the process exits 130, and --resume continues
from that checkpoint with every step exactly once."""
import collections
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from workers.checkpoint import latest_checkpoint

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

STEPS = 60  # a tiny-model step takes about 0.15 s: the signal lands mid-run
SPEC = {
    "name": "sigterm",
    "model": {"path": "builtin:tiny"},
    "task": {"dataset": "gen:add?max_digits=2", "size": 200, "eval_size": 4},
    "algorithm": {"loss": "ppo", "group_size": 4, "lr": 1.0e-3},
    "rollout": {"max_tokens": 12, "update_mode": "keep"},
    "schedule": {"mode": "async", "max_staleness": 1, "batch_prompts": 4},
    "trainer": {"checkpoint_every": 0},
    "stop": {"max_steps": STEPS, "max_minutes": 5},
    "eval": {"every_steps": 0, "prompts": 4},
}


def engine(tmp_path, *extra) -> subprocess.Popen:
    log = open(tmp_path / f"engine{len(list(tmp_path.glob('engine*.log')))}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "workers", "run", str(tmp_path / "spec.yaml"), "--out",
                             str(tmp_path / "out"), "--no-progress", *extra],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def trained_steps(out) -> list[int]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines if '"version/current"' in line]


def test_sigterm_saves_a_checkpoint_after_the_step_in_progress_and_resume_continues_from_it(tmp_path, tiny_model_path):
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    out = tmp_path / "out"
    first = engine(tmp_path)
    deadline = time.monotonic() + 600  # vLLM starting on a busy CPU
    while not trained_steps(out):
        assert first.poll() is None, (tmp_path / "engine0.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no trained step after 600 s"
        time.sleep(0.1)
    os.kill(first.pid, signal.SIGTERM)  # the engine process only, as `kill PID` would
    assert first.wait(timeout=300) == 130, (tmp_path / "engine0.log").read_text()[-3000:]
    checkpoint = latest_checkpoint(out)
    assert checkpoint is not None, (tmp_path / "engine0.log").read_text()[-3000:]
    done = trained_steps(out)
    assert checkpoint.step == max(done) < STEPS and done == list(range(1, checkpoint.step + 1))
    assert f"stopping after step {checkpoint.step}: checkpoint saved" in (tmp_path / "engine0.log").read_text()

    second = engine(tmp_path, "--resume")
    assert second.wait(timeout=400) == 0, (tmp_path / "engine1.log").read_text()[-3000:]
    assert f"--resume: continuing from {checkpoint.path} (step {checkpoint.step}" in (tmp_path / "engine1.log").read_text()
    assert json.loads((out / "resume.json").read_text())["from_step"] == checkpoint.step
    points = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    counts = collections.Counter((p["key"], p["step"]) for p in points)
    assert [k for k, n in counts.items() if n > 1] == []
    assert trained_steps(out) == list(range(1, STEPS + 1))
    assert json.loads((out / "result.json").read_text())["steps"] == STEPS
