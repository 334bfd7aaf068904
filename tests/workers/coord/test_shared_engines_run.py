"""Two LoRA runs of different teams on one shared engine (rollout.share_engines), each a real
training run in a process of its own (`python -m workers run`): they meet on one pool, each
keeps its metrics and its staleness bound, and killing one mid-run (as a cancel stops its
process group) leaves the other training to the end. (That neither run's generations come
from the other's adapter, exactly, is tests/workers/rollout/test_pool_engine.py.)"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from workers.rollout.pool_registry import DIR_ENV, IDLE_ENV, stop_pools

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def _spec(name, dataset, reward, steps):
    return {
        "name": name,
        "model": {"path": "builtin:tiny", "lora": {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}},
        "task": {"dataset": dataset, "size": 300, "eval_size": 8},
        "reward": {"function": reward},
        "algorithm": {"loss": "ppo", "group_size": 4, "lr": 5e-3, "warmup_steps": 0},
        "rollout": {"engines": 1, "max_tokens": 8, "update_mode": "keep", "share_engines": True},
        "schedule": {"mode": "async", "max_staleness": 1, "batch_prompts": 4},
        "stop": {"max_steps": steps, "max_minutes": 8},
        "eval": {"every_steps": 0, "prompts": 8},
    }


def _start(tmp_path, spec, team, pools):
    folder = tmp_path / team
    folder.mkdir()
    (folder / "spec.yaml").write_text(yaml.safe_dump(spec))
    env = {**os.environ, DIR_ENV: str(pools), IDLE_ENV: "5", "FLUXRL_POOL_TEAM": team,
           "FLUXRL_POOL_RUN": f"{spec['name']} of {team}"}
    log = open(folder / "engine.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "workers", "run", str(folder / "spec.yaml"), "--out",
                             str(folder / "out"), "--no-progress"], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    return proc, folder / "out"


def _points(out, key):
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [p for p in map(json.loads, path.read_text().splitlines()) if p["key"] == key]


def _wait(what, check, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not check():
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.5)


def test_two_teams_runs_share_an_engine_and_one_survives_the_other_being_killed(tmp_path):
    pools = tmp_path / "pools"
    pools.mkdir(mode=0o700)
    a, a_out = _start(tmp_path, _spec("long-add", "gen:add?max_digits=2", "numeric_match", 100000), "team-a", pools)  # runs until killed
    b = None
    try:
        _wait("a's first step on the pool", lambda: _points(a_out, "pool/runs"), a)
        b, b_out = _start(tmp_path, _spec("countdown", "gen:countdown", "countdown_check", 24), "team-b", pools)
        _wait("both runs on the pool", lambda: any(p["value"] == 2 for p in _points(b_out, "pool/runs")), b)
        os.killpg(a.pid, signal.SIGKILL)  # a cancelled run's whole process group stops
        a.wait()
        assert b.wait(timeout=600) == 0, (tmp_path / "team-b" / "engine.log").read_text()[-3000:]
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(DIR_ENV, str(pools))
            stop_pools()
    result = json.loads((b_out / "result.json").read_text())
    assert result["steps"] == 24 and result["staleness_max"] <= 1  # b's own bound, kept throughout
    runs = [p["value"] for p in sorted(_points(b_out, "pool/runs"), key=lambda p: p["step"])]
    assert 2 in runs and runs[-1] == 1  # shared, then alone once a was gone
    shares = [p["value"] for p in _points(b_out, "pool/fair_share")]
    assert 0.5 in shares and shares[-1] == 1.0
    assert len(_points(b_out, "staleness/max")) == 24
    a_points = _points(a_out, "pool/runs")
    assert a_points and not (a_out / "result.json").exists()  # a was killed mid-run
