"""The ``report`` section (metric exporters) and the platform's policy for it: exporter
folders stay inside the run's output folder, an MLflow server is one the deployment
allows, tracker names stay in the team's namespace."""
from __future__ import annotations

import re
from typing import Literal, Optional, cast

from pydantic import Field, field_validator

from workers.spec.base import _Strict


def _switch(value):
    """``tensorboard: true`` is ``tensorboard: {}`` (all defaults); ``false`` is off."""
    if value is True:
        return {}
    return None if value is False else value


class TensorBoardReport(_Strict):
    dir: str = Field("tensorboard", min_length=1, max_length=1000, description="the event files' folder; relative: "
                     "under the run's output folder")


class MlflowReport(_Strict):
    tracking_uri: Optional[str] = Field(None, min_length=1, max_length=1000, description=(
        "an MLflow server (http://host:5000), or a local folder: a file store, which works offline (relative: "
        "under the run's output folder). Default: $MLFLOW_TRACKING_URI where the engine runs, else 'mlruns' in "
        "the run's output folder"))
    experiment: str = Field("fluxrl", min_length=1, max_length=250, description="the experiment, created if missing")
    run_name: Optional[str] = Field(None, min_length=1, max_length=250, description="default: the spec's name")
    tags: dict[str, str] = Field(default_factory=dict, max_length=100, description="tags set on the MLflow run")

    @field_validator("tracking_uri")
    @classmethod
    def _one_server(cls, uri: Optional[str]) -> Optional[str]:
        # a server URI must name one host to every parser that reads it, and carry no
        # credentials: those come from the environment where the engine runs, never a spec
        from pydantic_core import PydanticCustomError

        if uri is not None and uri.partition("://")[0].strip().lower() in ("http", "https"):
            problem = check_server_uri(uri)[1]
            if problem:
                raise PydanticCustomError("tracking_uri", "{problem}", {"problem": problem})
        return uri


class WandbReport(_Strict):
    project: str = Field("fluxrl", min_length=1, max_length=128)
    entity: Optional[str] = Field(None, min_length=1, max_length=128, description="team or user (online mode)")
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: written to <dir>/wandb/offline-run-*, uploaded later by `wandb sync`; "
        "online: streamed to W&B (needs WANDB_API_KEY and the network where the engine runs)")
    dir: str = Field(".", min_length=1, max_length=1000, description="where wandb/ is written; relative: under "
                     "the run's output folder")
    name: Optional[str] = Field(None, min_length=1, max_length=250, description="default: the spec's name")
    group: Optional[str] = Field(None, min_length=1, max_length=128)
    tags: list[str] = Field(default_factory=list, max_length=64)


class ReportSpec(_Strict):
    """Where a run's metric points go besides metrics.jsonl and the platform: each exporter set
    here gets every point the dashboard gets (workers/io/exporters.py). One that fails is
    logged and dropped; training goes on."""
    tensorboard: Optional[TensorBoardReport] = Field(None, description="TensorBoard event files")
    mlflow: Optional[MlflowReport] = Field(None, description="an MLflow run")
    wandb: Optional[WandbReport] = Field(None, description="a Weights & Biases run (offline by default)")

    @field_validator("tensorboard", "mlflow", "wandb", mode="before")
    @classmethod
    def _on_off(cls, value):
        return _switch(value)

    def enabled(self) -> list[str]:
        return [name for name in ("tensorboard", "mlflow", "wandb") if getattr(self, name) is not None]


_SERVER_AUTHORITY = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")


def check_server_uri(uri: str) -> tuple[Optional[str], Optional[str]]:
    """``(origin, None)`` for an http(s) URI naming one server, ``origin`` being
    ``scheme://host:port`` (lower case, the default port filled in); ``(None, why not)``
    otherwise. The URI is read by urllib3's parser, the one MLflow's client connects with,
    and refused wherever two readers could disagree on the host: a backslash (urllib3 ends
    the authority there, urlsplit does not), spaces and control characters, '%' escapes,
    userinfo ('user:password@': credentials never come from a spec), a query or fragment."""
    from urllib.parse import urlsplit

    from urllib3.exceptions import LocationParseError
    from urllib3.util import parse_url

    if not uri.isascii() or any(c == "\\" or c.isspace() or not c.isprintable() for c in uri):
        return None, "an MLflow server URI must not contain backslashes, spaces, control or non-ASCII characters"
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return None, "an MLflow server (http:// or https://) or a folder inside the run's output folder"
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in authority:
        return None, ("credentials do not belong in the URI: the operator sets them where the engine runs "
                      "(MLFLOW_TRACKING_USERNAME and _PASSWORD, or MLFLOW_TRACKING_TOKEN)")
    if "?" in rest or "#" in rest:
        return None, "an MLflow server URI is scheme://host:port[/path], without a query or fragment"
    if not _SERVER_AUTHORITY.fullmatch(authority):
        return None, "an MLflow server URI's host is letters, digits, '.' and '-' (or [IPv6]), then :port"
    try:
        parsed, split = parse_url(uri), urlsplit(uri)
        port = parsed.port or {"http": 80, "https": 443}[scheme.lower()]
        same = (parsed.host or "").strip("[]").lower() == (split.hostname or "") and parsed.port == split.port
    except (LocationParseError, ValueError):
        return None, "not a URI"
    if parsed.auth is not None or not parsed.host or not same or not 0 < port < 65536:
        return None, "an MLflow server URI is scheme://host:port[/path]"
    from workers.io.exporters import connected_origin  # the origin as the exporter compares it

    return connected_origin(uri), None


def server_origin(uri: str) -> Optional[str]:
    """``scheme://host:port`` of an http(s) URI that check_server_uri accepts, or None."""
    return check_server_uri(uri)[0]


def report_paths_outside_run(report: ReportSpec, mlflow_servers: Optional[list[str]] = None
                             ) -> list[dict[str, str]]:
    """The exporter folders of ``report`` that would leave the run's output folder (an
    absolute path, '..', a file: URI), as SpecError entries: the platform refuses them, a
    run there may write only inside its own folder. An MLflow server URI must be one of
    ``mlflow_servers`` (origins, the platform's FLUXRL_MLFLOW_SERVERS) where that is given:
    a worker posts to it from inside the cluster, so a team may not aim it at an address of
    its choosing (the metadata service, an internal API)."""
    import posixpath

    def outside(path: str) -> bool:
        return posixpath.isabs(path) or path.startswith("~") or ".." in posixpath.normpath(path).split("/")

    errors = []
    for name in ("tensorboard", "wandb"):
        section = getattr(report, name)
        if section is not None and outside(section.dir):
            errors.append({"field": f"report.{name}.dir", "message": "must be a folder inside the run's output "
                           "folder (relative, without '..')"})
    uri = report.mlflow.tracking_uri if report.mlflow is not None else None
    if uri is not None and ("://" in uri or uri.partition(":")[0] in ("file", "sqlite", "databricks")):
        origin, problem = check_server_uri(uri)
        if origin is None:
            # check_server_uri gives its reason whenever it gives no origin
            errors.append({"field": "report.mlflow.tracking_uri", "message": cast(str, problem)})
        elif mlflow_servers is not None and origin not in {server_origin(a) for a in mlflow_servers}:
            # the whole origin (scheme, host, port as the connecting parser reads them) must be listed
            allowed = ", ".join(mlflow_servers) or "none: set FLUXRL_MLFLOW_SERVERS"
            errors.append({"field": "report.mlflow.tracking_uri", "message": f"{origin} is not an MLflow server this "
                           f"deployment allows (FLUXRL_MLFLOW_SERVERS: {allowed}); a folder inside the run's output "
                           "folder always works"})
    elif uri is not None and outside(uri):
        errors.append({"field": "report.mlflow.tracking_uri", "message": "must be a folder inside the run's output "
                       "folder (relative, without '..'), or an MLflow server (http:// or https://)"})
    return errors


def _mlflow_on_a_server(section: MlflowReport) -> bool:
    """Whether the MLflow run goes to a server: an http(s) URI, or none (the worker's
    MLFLOW_TRACKING_URI, the operator's server on a deployment); a folder is the run's own."""
    uri = section.tracking_uri
    return uri is None or uri.partition("://")[0].strip().lower() in ("http", "https")


def report_outside_namespace(report: ReportSpec, mlflow_prefix: str = "", wandb_prefix: str = "",
                             wandb_entity: str = "") -> list[dict[str, str]]:
    """The tracker names ``report`` sets outside a team's namespace on a shared tracker, as
    SpecError entries: an MLflow experiment on a server not starting with ``mlflow_prefix``;
    in W&B online mode (the worker uploads with the operator's key) a project not starting
    with ``wandb_prefix``, or an entity other than ``wandb_entity``. Letter case is ignored
    (W&B names are not case-sensitive). An empty prefix or entity sets no rule; names the
    report leaves unset are not checked (namespace_defaults gives them)."""
    def inside(name: str, prefix: str) -> bool:
        return name.casefold().startswith(prefix.casefold())

    errors = []
    mlflow, wandb = report.mlflow, report.wandb
    if (mlflow is not None and mlflow_prefix and _mlflow_on_a_server(mlflow) and "experiment" in mlflow.model_fields_set
            and not inside(mlflow.experiment, mlflow_prefix)):
        errors.append({"field": "report.mlflow.experiment", "message": f"the team's MLflow experiments are named "
                       f"'{mlflow_prefix}...' on the shared server: name it '{mlflow_prefix}{mlflow.experiment}', or "
                       "leave it out for the team's default"})
    if wandb is not None and wandb.mode == "online":
        if wandb_prefix and "project" in wandb.model_fields_set and not inside(wandb.project, wandb_prefix):
            errors.append({"field": "report.wandb.project", "message": f"the team's W&B projects are named "
                           f"'{wandb_prefix}...': name it '{wandb_prefix}{wandb.project}', or leave it out for the "
                           "team's default"})
        if wandb_entity and wandb.entity is not None and wandb.entity.casefold() != wandb_entity.casefold():
            errors.append({"field": "report.wandb.entity", "message": f"runs here log to the W&B entity "
                           f"'{wandb_entity}' (the operator's): leave it out, or give that one"})
    return errors


def namespace_defaults(report: ReportSpec, mlflow_prefix: str = "", wandb_prefix: str = "",
                       wandb_entity: str = "") -> dict[str, dict[str, str]]:
    """The names to fill in where ``report`` leaves them unset, so that they fall in the
    team's namespace: the usual default ('fluxrl') under the prefix, the operator's entity."""
    filled: dict[str, dict[str, str]] = {}
    mlflow, wandb = report.mlflow, report.wandb
    if (mlflow is not None and mlflow_prefix and _mlflow_on_a_server(mlflow)
            and "experiment" not in mlflow.model_fields_set):
        filled["mlflow"] = {"experiment": mlflow_prefix + MlflowReport.model_fields["experiment"].default}
    if wandb is not None and wandb.mode == "online":
        if wandb_prefix and "project" not in wandb.model_fields_set:
            filled.setdefault("wandb", {})["project"] = wandb_prefix + WandbReport.model_fields["project"].default
        if wandb_entity and wandb.entity is None:
            filled.setdefault("wandb", {})["entity"] = wandb_entity
    return filled
