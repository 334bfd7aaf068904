"""rollout.weight_transport rpc sends the whole model to each engine server as one blob,
which the wire refuses over FLUXRL_WIRE_MAX_BLOB_MB. A run whose model is over the cap is
refused before any process starts, with the numbers and the ways out (it used to end at
its first update with "every rollout engine died" and no word of the cap)."""
import os
import subprocess
import sys
import time

import pytest
import yaml

from workers.cluster.placement import (Machine, ModelSize, PlacementError, check_weight_transport, plan_cpu,
                                      plan_placement)
from workers.spec import validate_spec

GPU = Machine(cpu_cores=8, gpus_per_node=2, gpu_memory_gib=141)
QWEN_1_5B = ModelSize(1_543_714_304)  # Qwen2.5-1.5B's parameters: 5.75 GiB in float32, 2.88 GiB in bfloat16


def spec(dtype="float32", transport="rpc", queue="gpu", **resources):
    return validate_spec({"name": "t", "model": {"path": "m", "dtype": dtype}, "task": {"dataset": "gen:add"},
                          "rollout": {"weight_transport": transport}, "schedule": {"mode": "async"},
                          "resources": {"queue": queue, **resources}})


def test_a_model_over_the_blob_cap_is_refused_at_planning_naming_the_sizes_and_the_ways_out():
    with pytest.raises(PlacementError) as refused:
        plan_placement(spec("float32"), GPU, QWEN_1_5B)
    message = str(refused.value)
    assert message.startswith("rollout.weight_transport: rpc sends the model's weights to each engine server as "
                              "one blob of about 5.75 GiB (1,543,714,304 parameters in float32), over "
                              "FLUXRL_WIRE_MAX_BLOB_MB (4.00 GiB)")
    assert "rollout.weight_transport collective" in message and "bfloat16" in message


def test_the_same_model_fits_in_bfloat16_or_through_the_collective_transport():
    assert plan_placement(spec("bfloat16"), GPU, QWEN_1_5B).engines
    assert plan_placement(spec("float32", transport="collective"), GPU, QWEN_1_5B).engines


def test_the_cap_is_the_environments_and_engines_inside_the_coordinator_send_no_blob(monkeypatch):
    monkeypatch.setenv("FLUXRL_WIRE_MAX_BLOB_MB", "1")
    tiny = ModelSize(400_000)  # 1.5 MiB in float32: over a 1 MiB cap
    cpu = Machine(cpu_cores=2)
    with pytest.raises(PlacementError, match=r"over FLUXRL_WIRE_MAX_BLOB_MB \(0.00 GiB\)"):
        check_weight_transport(spec(queue="cpu"), plan_cpu(spec(queue="cpu"), cpu), tiny)
    inside = spec(queue="cpu", engine_processes=False)
    check_weight_transport(inside, plan_cpu(inside, cpu), tiny)  # no wire: nothing to refuse
    check_weight_transport(spec(queue="cpu"), plan_cpu(spec(queue="cpu"), cpu), None)  # size unknown: not checked


@pytest.mark.engine
def test_a_run_over_the_cap_exits_2_naming_the_cap_before_any_engine_starts(tmp_path, tiny_model_path):
    """The real CLI on the tiny model (~0.3 M parameters, ~1.3 MB in float32) with a 1 MB cap."""
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({
        "name": "blob-cap", "model": {"path": "builtin:tiny"},
        "task": {"dataset": "gen:add?max_digits=2", "size": 40, "eval_size": 8},
        "reward": {"function": "numeric_match"}, "algorithm": {"group_size": 2},
        "rollout": {"max_tokens": 8}, "schedule": {"mode": "sync", "batch_prompts": 2},
        "stop": {"max_steps": 1}, "eval": {"every_steps": 0, "prompts": 8}}))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "workers", "run", str(path), "--out", str(tmp_path / "out"),
                           "--no-progress"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "FLUXRL_WIRE_MAX_BLOB_MB": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "over FLUXRL_WIRE_MAX_BLOB_MB" in proc.stderr and "rollout.weight_transport collective" in proc.stderr
    assert "every rollout engine died" not in proc.stderr
    assert time.monotonic() - started < 120
