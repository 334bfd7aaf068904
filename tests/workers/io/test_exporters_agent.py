"""An agentic run's agent/* metrics reach TensorBoard, MLflow and W&B under their own names,
agent/end/<reason> (two slashes) included."""
from tests.workers.exported import mlflow_metrics, tensorboard_scalars, wandb_history, wandb_run
from tests.workers.io.test_exporters import ALL_THREE, by_step, expected_series, exporters_for
from workers.io.report import Reporter

AGENT_STREAM = [
    (1, {"agent/turns": 2.5, "agent/tool_calls": 1.25, "agent/tool_errors": 0.25, "agent/tool_ms": 3.5,
         "agent/observation_tokens": 12.0, "agent/token_exact": 1.0, "agent/versions_per_episode": 1.5,
         "agent/end/done": 0.75, "agent/end/max_turns": 0.25, "agent/end/environment_error": 0.0}),
    (2, {"agent/turns": 3.0, "agent/end/done": 0.5, "agent/end/max_episode_tokens": 0.5}),
]


def test_agent_metrics_pass_through_all_three_exporters_by_name(tmp_path):
    out = tmp_path / "run"
    reporter = Reporter(out / "metrics.jsonl")
    reporter.exporters = exporters_for(ALL_THREE, out)
    for step, values in AGENT_STREAM:
        reporter.log(step, values)
    assert reporter.exporters.close() == {"tensorboard": "ok", "mlflow": "ok", "wandb": "ok"}
    reporter.close()
    expected = by_step(expected_series(AGENT_STREAM))
    assert by_step(tensorboard_scalars(out / "tensorboard")) == expected
    _, metrics = mlflow_metrics((out / "mlruns").as_uri(), "unit")
    assert by_step(metrics) == expected  # '/' is a legal MLflow name character: nothing renamed
    _, records = wandb_run(out)
    assert wandb_history(records) == expected_series(AGENT_STREAM)
