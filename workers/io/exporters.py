"""Metric exporters: the run's metric points, the same stream metrics.jsonl and the dashboard
get (docs/architecture.md §5), also written to TensorBoard, MLflow or Weights & Biases
(the run spec's ``report`` section, workers/spec/report.py ReportSpec).

An exporter is a side channel and never stops training: each one is opened and fed on a
thread of its own (a slow or unreachable MLflow server does not hold up a step), and one
that fails (a bad URI, a package missing, a full disk) is logged once, at ERROR (the run
page shows the engine log's tail), dropped, and named in ``Exporters.status`` (result.json).
The packages are imported only when a run asks for their exporter.

Steps are the engine's: most points are a training step's, a few are keyed by a policy
version (weights/gen_stall_ms) and evaluation points repeat a step, so a step may come
again after a later one. TensorBoard and MLflow take (key, step) points in any order; W&B
wants its own step to grow, so each log call carries the engine's step as the metric
``step``, declared the x-axis of every other key.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import deque
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)

STATE_FILE = "exporters.json"  # the MLflow and W&B run ids, so that --resume continues the same runs


def under(out_dir: Path, path: str) -> Path:
    """A spec's folder: relative ones are under the run's output folder."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(out_dir) / p


class Exporter:
    """One destination. ``open`` may be slow (imports, a server); ``write`` gets lists of
    points {key, step, value, time}; ``close`` ends the destination's run. Any of them may
    raise: Exporters then drops this exporter."""

    name = "?"

    def __init__(self, settings: dict, out_dir: Path, run_name: str, config: dict, state: dict,
                 resume_step: Optional[int]):
        self.settings, self.out, self.run_name, self.config = settings, Path(out_dir), run_name, config
        self.state, self.resume_step = state, resume_step

    def open(self) -> None:
        raise NotImplementedError

    def write(self, points: list[dict]) -> None:
        raise NotImplementedError

    def close(self, failed: bool) -> None:
        pass

    def where(self) -> str:
        """What to tell the user: where the records are."""
        return ""


class TensorBoardExporter(Exporter):
    """Event files (torch's SummaryWriter): one scalar series per key, at the engine's step
    and wall-clock time. A resumed run purges the events after its checkpoint's step."""

    name = "tensorboard"

    def open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter  # extra: exporters

        self.dir = under(self.out, self.settings["dir"])
        purge = None if self.resume_step is None else self.resume_step + 1
        self.writer = SummaryWriter(log_dir=str(self.dir), purge_step=purge, flush_secs=30)

    def write(self, points: list[dict]) -> None:
        for p in points:
            self.writer.add_scalar(p["key"], p["value"], global_step=p["step"], walltime=p["time"])
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()

    def where(self) -> str:
        return str(self.dir)


def connected_origin(uri: str) -> Optional[str]:
    """``scheme://host:port`` that an HTTP client connects to for ``uri`` (urllib3's reading,
    userinfo ignored), or None."""
    from urllib3.util import parse_url

    try:
        parsed = parse_url(uri.strip())
        port = parsed.port or {"http": 80, "https": 443}.get(parsed.scheme or "")
    except ValueError:  # urllib3's LocationParseError is one
        return None
    return f"{parsed.scheme}://{parsed.host.lower()}:{port}" if parsed.scheme and parsed.host and port else None


# the environment's tracker credentials: their values never appear in what is logged
CREDENTIAL_VARIABLES = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                        "MLFLOW_TRACKING_AUTH", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "DATABRICKS_TOKEN",
                        "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AZURE_STORAGE_ACCESS_KEY",
                        "AZURE_STORAGE_CONNECTION_STRING", "GOOGLE_APPLICATION_CREDENTIALS")
_CREDENTIAL_TEXT = [
    (re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=-]{6,}"), r"\1\2***"),
    (re.compile(r"(?i)((?:api[_-]?key|access[_-]?key|token|passw(?:or)?d|secret|authorization|credentials?|auth)"
                r"[\"']?\s*[:=]\s*[\"']?)[^\s\"',;&}]+"), r"\1***"),
    (re.compile(r"://[^/\s@]*@"), "://***@"),  # userinfo in a URL
]
MAX_REASON_CHARS = 200


def scrub(text: str, secrets: tuple[str, ...] = ()) -> str:
    """``text`` with credential-like parts replaced by ***: the values in ``secrets``,
    'token=...', 'password: ...', 'Bearer ...', a URL's userinfo."""
    for secret in secrets:
        text = text.replace(secret, "***")
    for pattern, replacement in _CREDENTIAL_TEXT:
        text = pattern.sub(replacement, text)
    return text


def environment_secrets() -> tuple[str, ...]:
    return tuple(v for v in (os.environ.get(name, "") for name in CREDENTIAL_VARIABLES) if len(v) >= 4)


def failure_reason(exc: BaseException, secrets: tuple[str, ...] = ()) -> str:
    """What an exporter's failure is logged as, and shown in result.json: the exception's
    class, the tracker's error code and HTTP status where it answered, and the message only
    where it is the client's own. A tracker's reply (MLflow puts the response body in its
    exception) is text anyone able to serve that address chose, and may echo the request's
    credentials: it is never repeated; the rest is scrubbed and cut short."""
    parts = [type(exc).__name__]
    code = getattr(exc, "error_code", None)
    if isinstance(code, str) and re.fullmatch(r"[A-Z][A-Z0-9_]{0,63}", code):
        parts.append(code)
    status = None
    response = getattr(exc, "response", None)
    if isinstance(getattr(response, "status_code", None), int):
        status = response.status_code
    elif callable(getattr(exc, "get_http_status_code", None)) and code is not None:
        try:
            status = int(exc.get_http_status_code())
        except (TypeError, ValueError):
            status = None
    if status is not None:
        parts.append(f"HTTP {status}")
    text = str(exc)
    # MLflow's RestException keeps the reply as .json; its other errors quote it after
    # "Response body"; W&B's CommError and requests' HTTPError carry the server's words
    from_tracker = (response is not None or hasattr(exc, "json") or "Response body" in text
                    or type(exc).__name__ in ("CommError", "HTTPError"))
    head = " ".join(parts)
    if from_tracker:
        return f"{head} (the tracker's reply is not logged)"
    reason = scrub(text, secrets)
    reason = reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 3] + "..."
    return f"{head}: {reason}" if reason else head


def mlflow_key(key: str) -> str:
    """MLflow refuses '@' in a metric name (eval/<set>/pass@<k>): it becomes '_at_', as verl does."""
    return key.replace("@", "_at_")


class MlflowExporter(Exporter):
    """An MLflow run in ``experiment`` (created if missing): the spec's fields as params,
    every point as a metric at its step. A local folder is a file store, which MLflow 3
    allows only with MLFLOW_ALLOW_FILE_STORE set: it is set here for this process, the
    folder being what the spec asked for (the sqlite store needs SQLAlchemy, which
    mlflow-skinny does not bring)."""

    name = "mlflow"
    MAX_BATCH = 1000  # MLflow's log_batch limit on metrics
    MAX_PARAMS = 100  # and on params
    MAX_PARAM_CHARS = 6000
    PARAM_NAME = re.compile(r"[\w\-. /]{1,250}")  # the names MLflow accepts

    def tracking_uri(self) -> str:
        uri = self.settings.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") or "mlruns"
        if "://" in uri or uri.partition(":")[0] in ("file", "sqlite", "databricks"):  # a URI; else a folder
            local = uri.startswith("file:")
        else:
            uri, local = under(self.out, uri).resolve().as_uri(), True
        if local:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        return uri

    # what MLflow's client attaches to every request, read from the environment at request time
    CREDENTIALS = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                   "MLFLOW_TRACKING_AUTH", "MLFLOW_TRACKING_CLIENT_CERT_PATH", "MLFLOW_TRACKING_SERVER_CERT_PATH")

    def keep_credentials_home(self, uri: str) -> None:
        """The worker's MLflow credentials belong to its own server (MLFLOW_TRACKING_URI): a
        spec that names another server (any team member writes specs) must not receive them,
        so they leave this process's environment before the client is made. Both URIs are
        read by urllib3's parser, the one the client connects with."""
        home = os.environ.get("MLFLOW_TRACKING_URI", "")
        target = connected_origin(uri)
        if home and (uri == home or (target is not None and target == connected_origin(home))):
            return
        dropped = [name for name in self.CREDENTIALS if os.environ.pop(name, None) is not None]
        if dropped:
            log.warning("report.mlflow: %s is not this worker's MLFLOW_TRACKING_URI; its credentials (%s) are not "
                        "sent there", target or "the spec's tracking_uri", ", ".join(dropped))

    def open(self) -> None:
        from mlflow.entities import Param  # extra: exporters
        from mlflow.tracking import MlflowClient  # extra: exporters

        self.uri = self.tracking_uri()
        self.keep_credentials_home(self.uri)
        self.client = MlflowClient(tracking_uri=self.uri)
        name = self.settings["experiment"]
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        run_id = self.state.get("mlflow_run_id") if self.resume_step is not None else None
        if run_id:  # --resume: the same MLflow run goes on (steps after the checkpoint are logged again)
            self.client.update_run(run_id, status="RUNNING")
        else:
            tags = {"fluxrl.spec_name": self.run_name, **self.settings.get("tags", {})}
            run = self.client.create_run(experiment_id, run_name=self.settings.get("run_name") or self.run_name,
                                         tags=tags)
            run_id = run.info.run_id
            # (a key MLflow would refuse, e.g. a user's tag name in report.mlflow.tags, is left out)
            params = [Param(k, v[: self.MAX_PARAM_CHARS]) for k, v in flatten(self.config).items()
                      if self.PARAM_NAME.fullmatch(k)]
            for i in range(0, len(params), self.MAX_PARAMS):
                self.client.log_batch(run_id, params=params[i: i + self.MAX_PARAMS])
        self.run_id = self.state["mlflow_run_id"] = run_id

    def write(self, points: list[dict]) -> None:
        from mlflow.entities import Metric  # extra: exporters

        metrics = [Metric(mlflow_key(p["key"]), p["value"], int(p["time"] * 1000), p["step"]) for p in points]
        for i in range(0, len(metrics), self.MAX_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i: i + self.MAX_BATCH])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")

    def where(self) -> str:
        return f"{self.uri} run {self.run_id}"


class WandbExporter(Exporter):
    """A W&B run, offline by default: written under <dir>/wandb/offline-run-*/, uploaded
    later with `wandb sync <that folder>`. The spec is the run's config. Nothing of the
    machine is collected (no system stats, git or code): the points are the record."""

    name = "wandb"

    def open(self) -> None:
        import wandb  # extra: exporters

        self.dir = under(self.out, self.settings["dir"])
        self.dir.mkdir(parents=True, exist_ok=True)
        s = self.settings
        run_id = self.state.get("wandb_run_id") if self.resume_step is not None else None
        self.run = wandb.init(
            project=s["project"], entity=s.get("entity"), name=s.get("name") or self.run_name, group=s.get("group"),
            tags=s.get("tags") or None, dir=str(self.dir), mode=s["mode"], config=self.config,
            id=run_id, resume="allow" if run_id else None,
            settings=wandb.Settings(silent=True, console="off", disable_git=True, save_code=False,
                                    x_disable_stats=True, x_disable_machine_info=True, disable_job_creation=True,
                                    reinit="create_new"))
        self.state["wandb_run_id"] = self.run.id
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, points: list[dict]) -> None:
        row: dict[str, float] = {}
        step = None
        for p in points:  # a row per run of points at one step, in the order they came
            if row and (p["step"] != step or p["key"] in row):
                self.run.log({**row, "step": step})
                row = {}
            step, row[p["key"]] = p["step"], p["value"]
        if row:
            self.run.log({**row, "step": step})

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)

    def where(self) -> str:
        return str(getattr(self.run, "dir", self.dir))


EXPORTERS = {"tensorboard": TensorBoardExporter, "mlflow": MlflowExporter, "wandb": WandbExporter}


def flatten(config: Any, prefix: str = "") -> dict[str, str]:
    """A nested spec as {"a.b": "value"} strings (MLflow params); lists as JSON."""
    if isinstance(config, dict):
        flat: dict[str, str] = {}
        for key, value in config.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    if config is None:
        return {}
    return {prefix[:-1]: config if isinstance(config, str) else json.dumps(config)}


class Exporters:
    """The run's exporters, fed on one thread: ``put`` (from Reporter.log) never blocks or
    raises. ``status`` names each exporter's state: "ok", or the error that dropped it."""

    def __init__(self, exporters: list[Exporter], out_dir: Optional[Path] = None, max_points: int = 500_000):
        self.exporters = exporters
        self.state_path = Path(out_dir) / STATE_FILE if out_dir is not None else None
        self.status: dict[str, str] = {e.name: "starting" for e in exporters}
        self.max_points = max_points
        self.secrets = environment_secrets()  # read now: the MLflow exporter may drop them from the environment
        self.dropped = 0
        self._queue: deque[list[dict]] = deque()
        self._queued = 0
        self._wake = threading.Condition()
        self._closing = False
        self._failed_run = False
        self._thread = threading.Thread(target=self._loop, name="fluxrl-exporters", daemon=True)

    def start(self) -> "Exporters":
        self._thread.start()
        return self

    def put(self, points: list[dict]) -> None:
        if not points:
            return
        with self._wake:
            if self._closing:
                return
            if self._queued + len(points) > self.max_points:  # exporters far behind: drop, never grow unbounded
                if not self.dropped:
                    log.warning("exporters are %d points behind: dropping new points (metrics.jsonl keeps them)",
                                self._queued)
                self.dropped += len(points)
                return
            self._queue.append(points)
            self._queued += len(points)
            self._wake.notify()

    def close(self, failed: bool = False, timeout_s: float = 120.0) -> dict[str, str]:
        """Write what is queued, end each exporter's run (FAILED in MLflow, exit code 1 in
        W&B when ``failed``) and wait up to timeout_s for it. Returns ``status``."""
        with self._wake:
            self._closing, self._failed_run = True, failed
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                log.error("exporters still busy after %.0f s at the end of the run; leaving them", timeout_s)
        return dict(self.status)

    @property
    def live(self) -> list[Exporter]:
        return [e for e in self.exporters if self.status[e.name] == "ok"]

    def _fail(self, exporter: Exporter, doing: str, exc: BaseException) -> None:
        """Drop an exporter: logged once, at ERROR, with what it was doing."""
        reason = failure_reason(exc, self.secrets)  # the run's log and result.json: the team reads both
        self.status[exporter.name] = f"failed ({doing}): {reason}"
        hint = " (pip install its package on the worker)" if isinstance(exc, ImportError) else ""
        log.error("report.%s failed while %s: %s%s; training goes on without it", exporter.name, doing, reason, hint)

    def _loop(self) -> None:
        state = self._read_state()
        for exporter in self.exporters:
            exporter.state = state
            try:
                exporter.open()
                self.status[exporter.name] = "ok"
                log.info("report.%s: writing to %s", exporter.name, scrub(exporter.where(), self.secrets))
            except BaseException as exc:  # noqa: BLE001 - an exporter never stops the run
                self._fail(exporter, "opening", exc)
        self._write_state(state)
        while True:
            with self._wake:
                while not self._queue and not self._closing:
                    self._wake.wait()
                if not self._queue:
                    break
                batch: list[dict] = []
                while self._queue and len(batch) < 5000:
                    batch.extend(self._queue.popleft())
                self._queued -= len(batch)
            for exporter in self.live:
                try:
                    exporter.write(batch)
                except BaseException as exc:  # noqa: BLE001
                    self._fail(exporter, "writing", exc)
        for exporter in self.live:
            try:
                exporter.close(self._failed_run)
            except BaseException as exc:  # noqa: BLE001
                self._fail(exporter, "closing", exc)

    def _read_state(self) -> dict:
        try:
            return json.loads(self.state_path.read_text()) if self.state_path and self.state_path.exists() else {}
        except (OSError, ValueError):
            return {}

    def _write_state(self, state: dict) -> None:
        if self.state_path is None or not state:
            return
        try:
            self.state_path.write_text(json.dumps(state))
        except OSError as exc:
            log.warning("could not save the exporters' run ids to %s (--resume starts new ones): %s",
                        self.state_path, exc)


def open_exporters(report: dict, out_dir: str | Path, run_name: str, config: dict,
                   resume_step: Optional[int] = None) -> Optional[Exporters]:
    """The exporters ``report`` (a ReportSpec as a dict) asks for, started; None when it
    asks for none. ``config`` is the run's spec (MLflow params, W&B config); resume_step:
    the checkpoint a resumed run continues after."""
    chosen = [EXPORTERS[name](settings, Path(out_dir), run_name, config, {}, resume_step)
              for name, settings in (report or {}).items() if settings is not None]
    if not chosen:
        return None
    return Exporters(chosen, out_dir).start()

