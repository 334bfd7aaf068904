"""A real-shaped model end to end: Qwen2.5-0.5B's exact configuration (494 M
parameters, vocabulary 151,936; random weights) trained for 3 steps by vLLM and DeepSpeed
on this CPU from examples/own-model/real-size.yaml, its weights going to the engine server in
bounded chunks. Not in the default run (minutes, most of a 24 GB machine):
``pytest -m scale``."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.scale, pytest.mark.engine, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]


def test_the_real_size_example_trains_three_steps_and_reports_each_processs_peak(tmp_path):
    from workers.models.modelzoo import ensure_zoo_model
    from workers.models.zoo_data import write_chat_dataset
    from workers.models.realsize import build_shaped_model

    model = build_shaped_model("qwen2.5-0.5b", tmp_path / "qwen2.5-0.5b", ensure_zoo_model("qwen2"))
    config = json.loads((model / "config.json").read_text())
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (151936, 896, 24)
    assert json.loads((model / "fluxrl_shape.json").read_text())["params"] == 494_032_768
    spec = yaml.safe_load((REPO / "examples" / "own-model" / "real-size.yaml").read_text())
    spec["model"]["path"] = str(model)
    spec["task"]["dataset"] = str(write_chat_dataset(tmp_path / "chat.jsonl", 200, seed=7, two_digit=True))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    done = subprocess.run([sys.executable, "-m", "workers", "run", str(tmp_path / "spec.yaml"), "--out",
                           str(tmp_path / "out"), "--no-progress"], capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["steps"] == 3, result
    peaks = result["memory_peak_gib"]
    assert {"coordinator", "engine 0 server", "engine 0 vLLM core"} <= set(peaks), peaks
    assert sum(peaks.values()) < 22, peaks  # it fits this 24 GB machine in bfloat16
    # the host-memory planner, within 25% of each process's measured peak
    planned = result["memory_plan_gib"]
    assert set(planned) == set(peaks), (planned, peaks)
    assert all(abs(planned[name] - peaks[name]) <= 0.25 * peaks[name] for name in peaks), (planned, peaks)
