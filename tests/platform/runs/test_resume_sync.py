"""A resumed run's database follows the engine, not the platform's newest reported
checkpoint: the engine says which step it resumed from as it starts running, the points
and samples after it are dropped then, and the points it computes again replace the old
ones. (The newest checkpoint on disk can be newer than the newest reported one: a
report that failed.)"""
from fluxrl.metrics.models import MetricPoint
from fluxrl.metrics.services import ingest_points
from fluxrl.runs import services
from fluxrl.runs.models import Run, RunStatus
from fluxrl.runs.services import add_checkpoint, add_samples, transition


def points(steps, value):
    return [{"key": key, "step": s, "value": value(s), "time": 1000.0 + s} for s in steps for key in ("a", "b")]


def rows(run):
    return sorted(MetricPoint.objects.filter(run=run).values_list("key", "step", "value"))


def failed_with_history(run, monkeypatch):
    monkeypatch.setattr(services, "enqueue_run", lambda run: None)
    run = transition(transition(run, RunStatus.STARTING), RunStatus.RUNNING)
    add_checkpoint(run, 2, 2, "ckpt/step-2")  # the report of step-4's checkpoint failed
    ingest_points(run, points(range(1, 7), lambda s: s / 10))
    add_samples(run, [{"step": s, "prompt": "1+1=", "completion": "2", "reward": 1.0, "versions": [s], "uid": f"u{s}"}
                      for s in range(1, 7)])
    return services.resume_run(transition(run, RunStatus.FAILED, failure_reason="lost"))


def test_the_points_and_samples_after_the_step_the_engine_resumed_from_are_dropped_as_it_starts_running(
        run_a, worker_client, monkeypatch):
    run = failed_with_history(run_a, monkeypatch)
    assert len(rows(run)) == 12 and run.samples.count() == 6  # resuming alone drops nothing
    worker = worker_client(transition(run, RunStatus.STARTING))

    reply = worker.post(f"/api/runs/{run.id}/status/", {"status": "running", "resumed_from_step": 4}, format="json")
    assert reply.status_code == 200 and reply.json()["status"] == "running"
    assert rows(run) == [(k, s, s / 10) for k in ("a", "b") for s in range(1, 5)]
    assert sorted(run.samples.values_list("uid", flat=True)) == ["u1", "u2", "u3", "u4"]

    # Step 5 again, computed anew: its value replaces nothing old and stays through a
    # later report of the same resume step.
    assert worker.post(f"/api/runs/{run.id}/metrics/", {"points": points([4, 5], lambda s: 50.0 + s)},
                       format="json").status_code == 201
    worker.post(f"/api/runs/{run.id}/status/", {"status": "running", "resumed_from_step": 4}, format="json")
    assert rows(run) == [(k, s, v) for k in ("a", "b") for s, v in ((1, 0.1), (2, 0.2), (3, 0.3), (4, 54.0), (5, 55.0))]


def test_an_engine_that_found_no_checkpoint_to_resume_from_drops_every_point_and_sample(run_a, worker_client, monkeypatch):
    run = failed_with_history(run_a, monkeypatch)
    worker = worker_client(transition(run, RunStatus.STARTING))
    assert worker.post(f"/api/runs/{run.id}/status/", {"status": "running", "resumed_from_step": -1},
                       format="json").status_code == 200
    assert rows(run) == [] and run.samples.count() == 0


def test_a_resume_step_below_minus_one_is_refused(run_a, worker_client, assert_error):
    worker = worker_client(transition(run_a, RunStatus.STARTING))
    assert_error(worker.post(f"/api/runs/{run_a.id}/status/", {"status": "running", "resumed_from_step": -2},
                             format="json"), 400, field="resumed_from_step")
    assert Run.objects.get(pk=run_a.pk).status == "starting"
