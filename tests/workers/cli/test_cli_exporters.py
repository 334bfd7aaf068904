"""A real run on the tiny model with all three exporters (report.tensorboard, report.mlflow,
report.wandb offline): every metric point in metrics.jsonl, the dashboard's stream, is read
back from each with the tool's own reader. Through the CLI, as a user (or the platform's
dispatcher) starts a run."""
import json
from collections import defaultdict

import pytest

from tests.workers.cli.test_cli import run_cli, with_
from tests.workers.exported import mlflow_metrics, tensorboard_scalars, wandb_config, wandb_history, wandb_run


def series_of(points) -> dict[str, list[tuple[int, float]]]:
    series = defaultdict(list)
    for p in points:
        series[p["key"]].append((p["step"], p["value"]))
    return dict(series)


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_a_run_with_all_three_exporters_writes_every_metric_point_to_each(tmp_path, tiny_model_path):
    spec = with_(name="exported", schedule={"mode": "sync", "batch_prompts": 4}, stop={"max_steps": 3},
                 eval={"every_steps": 2, "prompts": 8},
                 report={"tensorboard": {"dir": "tb"}, "mlflow": {"experiment": "cli"},
                         "wandb": {"project": "fluxrl-test", "mode": "offline"}})
    proc = run_cli(tmp_path, spec, timeout=840)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    result = json.loads((out / "result.json").read_text())
    assert result["steps"] == 3
    assert result["exporters"] == {"tensorboard": "ok", "mlflow": "ok", "wandb": "ok"}

    points = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = series_of(points)
    # the step metrics of every step, and the evaluations before, at step 2 and after
    assert [s for s, _ in expected["reward/mean"]] == [1, 2, 3]
    assert [s for s, _ in expected["eval/accuracy"]] == [0, 2, 3]
    assert len(expected) > 30

    def ordered(series):
        return {key: sorted(values) for key, values in series.items()}

    tb = tensorboard_scalars(out / "tb")  # float32 in the event files
    assert sorted(tb) == sorted(expected)
    for key, values in ordered(expected).items():
        assert [s for s, _ in ordered(tb)[key]] == [s for s, _ in values], key
        assert [v for _, v in ordered(tb)[key]] == pytest.approx([v for _, v in values], rel=1e-6, abs=1e-6), key

    run, metrics = mlflow_metrics((out / "mlruns").as_uri(), "cli")
    assert ordered(metrics) == ordered(expected)
    assert run.info.status == "FINISHED" and run.info.run_name == "exported"
    assert run.data.params["schedule.mode"] == "sync" and run.data.params["stop.max_steps"] == "3"

    _, records = wandb_run(out)
    assert wandb_history(records) == expected  # each key's points in the order the engine sent them
    assert wandb_config(records)["report"]["wandb"]["project"] == "fluxrl-test"
