"""Read back what the metric exporters wrote (workers/io/exporters.py), with each tool's own
reader: TensorBoard's EventAccumulator, MLflow's client, and W&B's record format (its
offline run file: LevelDB-log blocks of wandb.proto Record messages; wandb 0.31 ships no
Python reader for it). Each returns {key: [(step, value), ...]}."""
import json
import os
import struct
from pathlib import Path


def tensorboard_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def mlflow_metrics(tracking_uri: str, experiment: str) -> tuple[object, dict[str, list[tuple[int, float]]]]:
    """(the experiment's one run, its metric histories)."""
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 opens a file store only with it
    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    return run, {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
                 for key in run.data.metrics}


_BLOCK, _HEADER = 32768, 7  # the LevelDB log format W&B's transaction log uses
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(run_file) -> list:
    """Every Record in an offline run's run-<id>.wandb file."""
    from wandb.proto import wandb_internal_pb2

    data = Path(run_file).read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:_HEADER])
    assert ident == b":W&B" and magic == 0xBEE1, "not a W&B run file"
    records, pos, pending = [], _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0:  # zero padding to the block's end
            pos += left
            continue
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_run(run_root, wait_s: float = 30.0) -> tuple[Path, list]:
    """(the one offline-run-* folder under run_root/wandb, its records). W&B's service
    process writes the run file behind the client: read it again until it holds the run's
    exit record (the last one a finished run writes), for up to ``wait_s``."""
    import time

    folders = sorted(Path(run_root).glob("wandb/offline-run-*"))
    assert len(folders) == 1, folders
    deadline = time.monotonic() + wait_s
    while True:
        records = wandb_records(next(folders[0].glob("run-*.wandb")))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return folders[0], records
        time.sleep(0.2)


def wandb_history(records) -> dict[str, list[tuple[int, float]]]:
    """{key: [(engine step, value), ...]} from the history rows (the exporter logs the
    engine's step as the metric 'step')."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for key, value in row.items():
            if not key.startswith("_") and key != "step":
                series.setdefault(key, []).append((row["step"], value))
    return series


def wandb_config(records) -> dict:
    """The run's config: set with its run record, updated by config records."""
    config = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        updates = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        for item in updates:
            config[item.key] = json.loads(item.value_json)
    return config
