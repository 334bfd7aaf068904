"""Checkpoint and resume with the real engine. A SIGTERM (a host shutting down, a scheduler
pre-empting) lets the step in progress finish and saves a checkpoint after it, although
the spec saves none before the end; the process exits 130. The run resumed with --resume
from that checkpoint is then SIGKILLed (its whole process group, as a lost host would lose
it) after it has trained further, and resumed again. The curves must hold every step
exactly once, each resumed run must train from the checkpoint's step + 1 (what the killed
one trained past it is dropped), and the engine must generate with the checkpoint's
weights. (One chain of three processes: each start-up costs a vLLM engine and a trainer.)"""
import collections
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from workers.io.checkpoint import latest_checkpoint
from workers.weights.sync import serialize_state_dict, tensors_checksum

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

STEPS = 60  # a tiny-model step takes about 0.15 s: the signals land mid-run
SPEC = {
    "name": "resume",
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


def wait_for_trained_step(proc, out, log, after: int) -> None:
    """Until ``proc`` has trained a step past ``after``."""
    deadline = time.monotonic() + 600  # vLLM starting on a busy CPU
    while max(trained_steps(out), default=0) <= after:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no step past {after} trained after 600 s"
        time.sleep(0.05)


def test_sigterm_saves_a_checkpoint_after_the_step_in_progress_and_killed_runs_resume_from_it_without_gaps(
        tmp_path, tiny_model_path):
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    out = tmp_path / "out"

    # SIGTERM: the step in progress finishes, a checkpoint is saved after it, exit 130.
    first = engine(tmp_path)
    wait_for_trained_step(first, out, tmp_path / "engine0.log", 0)
    os.kill(first.pid, signal.SIGTERM)  # the engine process only, as `kill PID` would
    assert first.wait(timeout=300) == 130, (tmp_path / "engine0.log").read_text()[-3000:]
    checkpoint = latest_checkpoint(out)
    assert checkpoint is not None, (tmp_path / "engine0.log").read_text()[-3000:]
    done = trained_steps(out)
    assert checkpoint.step == max(done) < STEPS and done == list(range(1, checkpoint.step + 1))
    assert f"stopping after step {checkpoint.step}: checkpoint saved" in (tmp_path / "engine0.log").read_text()
    stopped_result = (out / "result.json").read_bytes()  # a stopped run reports where it stopped

    # --resume from it, SIGKILLed (the engine, vLLM and the trainer at once) once it has
    # trained past the checkpoint: no new checkpoint, no result of its own.
    second = engine(tmp_path, "--resume")
    wait_for_trained_step(second, out, tmp_path / "engine1.log", checkpoint.step)
    os.killpg(second.pid, signal.SIGKILL)
    second.wait()
    killed_at = time.time()
    assert latest_checkpoint(out).path == checkpoint.path and (out / "result.json").read_bytes() == stopped_result
    assert f"--resume: continuing from {checkpoint.path} (step {checkpoint.step}" in \
        (tmp_path / "engine1.log").read_text()

    # --resume again: from the same checkpoint, to the end.
    third = engine(tmp_path, "--resume")
    assert third.wait(timeout=400) == 0, (tmp_path / "engine2.log").read_text()[-3000:]
    log = (tmp_path / "engine2.log").read_text()
    assert f"--resume: continuing from {checkpoint.path} (step {checkpoint.step}" in log

    result = json.loads((out / "result.json").read_text())
    assert result["steps"] == STEPS and result["trained_samples"] == STEPS * 4 * 4

    points = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    counts = collections.Counter((p["key"], p["step"]) for p in points)
    assert [k for k, n in counts.items() if n > 1] == []  # no duplicate steps
    trained = sorted((p["step"], p["time"]) for p in points if p["key"] == "version/current")
    assert [s for s, _ in trained] == list(range(1, STEPS + 1))  # no gaps
    assert trained_steps(out) == list(range(1, STEPS + 1))
    assert [p["value"] for p in sorted((p for p in points if p["key"] == "version/current"), key=lambda p: p["step"])] \
        == list(range(1, STEPS + 1))
    # Steps up to the checkpoint come from the first process, the rest from the last one,
    # whose first trained step is the checkpoint's + 1: what the killed one trained is gone.
    assert all(t < killed_at for s, t in trained if s <= checkpoint.step)
    assert all(t > killed_at for s, t in trained if s > checkpoint.step)
    assert sorted(p["step"] for p in points if p["key"] == "eval/accuracy").count(0) == 1

    # The weights the resumed engine generated with are the checkpoint's.
    resumed = json.loads((out / "resume.json").read_text())
    assert resumed["from_step"] == checkpoint.step and resumed["version"] == checkpoint.version == checkpoint.step
    states = torch.load(checkpoint.path / "trainer" / "ds" / "mp_rank_00_model_states.pt", weights_only=False)
    from safetensors.torch import load as st_load

    saved = tensors_checksum(st_load(serialize_state_dict(states["module"])))
    assert resumed["checkpoint_sha256"] == resumed["trainer_sha256"] == saved
    assert resumed["engine_sha256"] == [saved]
