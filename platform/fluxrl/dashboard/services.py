"""What the dashboard pages show: the current team, the runs table, a run's metric
index, display spec and timeline, the run-spec form, config diffs and log tails.
Reads only: every change the pages make goes through the REST API."""
from __future__ import annotations

import json
from typing import Literal, Union, get_args, get_origin

import annotated_types
from django.db.models import DurationField, ExpressionWrapper, F, OuterRef, Subquery
from django.db.models.functions import Coalesce, Now
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from fluxrl.accounts.models import Membership
from fluxrl.accounts.services import get_visible_team, visible_teams
from fluxrl.datasets.models import DatasetVersion
from fluxrl.metrics.models import MetricPoint
from fluxrl.rewards.models import RewardVersion
from fluxrl.runs.models import Run, RunStatus, RunTag
from fluxrl.runs.services import filter_runs
from workers.tasks.builtin_rewards import BUILTIN_REWARDS
from workers.spec import RunSpec, SpecError, validate_spec
from workers.tasks.datasets import GENERATORS

SESSION_TEAM = "dashboard_team"
REWARD_KEY = "reward/mean"
THROUGHPUT_KEY = "throughput/samples_per_s"

# --- teams -------------------------------------------------------------------------------


def current_team(request):
    """The team the pages show: the one picked in this session if still one of the
    user's, else the user's first team (None for a user in no team)."""
    teams = visible_teams(request.user).order_by("slug")
    slug = request.session.get(SESSION_TEAM)
    return (teams.filter(slug=slug).first() if slug else None) or teams.first()


def switch_team(request, slug: str):
    team = get_visible_team(request.user, None, slug)  # NotFound for a team not one's own
    request.session[SESSION_TEAM] = team.slug
    return team


# --- runs table ----------------------------------------------------------------------------

RUN_SORTS = {
    "name": "name", "status": "status", "owner": "owner__username", "created": "created_at",
    "started": "started_at", "duration": "duration", "reward": "latest_reward", "throughput": "latest_throughput",
}


def latest_value(key: str) -> Subquery:
    # One index seek per run on (run, key, step): cheap however long the run.
    return Subquery(MetricPoint.objects.filter(run=OuterRef("pk"), key=key).order_by("-step").values("value")[:1])


def runs_table(team, status="", tag="", owner="", q="", sort="-created"):
    """The team's runs, filtered (runs.services.filter_runs), with their latest reward and
    throughput and duration, ordered by `sort` (a RUN_SORTS name, '-' for descending)."""
    runs = Run.objects.filter(team=team).select_related("owner").prefetch_related("tags")
    runs = filter_runs(runs, status=status, tag=tag, owner=owner, q=q).annotate(
        latest_reward=latest_value(REWARD_KEY),
        latest_throughput=latest_value(THROUGHPUT_KEY),
        duration=ExpressionWrapper(Coalesce("finished_at", Now()) - F("started_at"), output_field=DurationField()),
    )
    field = RUN_SORTS.get(sort.lstrip("-"), "created_at")
    order = F(field).desc(nulls_last=True) if sort.startswith("-") else F(field).asc(nulls_last=True)
    return runs.order_by(order, "-id")


def filter_choices(team) -> dict:
    return {
        "statuses": list(RunStatus.values),
        "tags": sorted(set(RunTag.objects.filter(run__team=team).values_list("name", flat=True))),
        "owners": sorted(Membership.objects.filter(team=team).values_list("user__username", flat=True)),
    }


def run_facts(run: Run) -> dict:
    """Model, algorithm and mode as the runs table and the run page show them."""
    spec = run.resolved_spec or {}
    schedule = spec.get("schedule", {})
    mode = schedule.get("mode", "")
    if mode == "async":
        mode = f"async η={schedule.get('max_staleness')}"
    return {
        "model": (run.spec.get("model") or {}).get("path", ""),
        "algorithm": spec.get("algorithm", {}).get("loss", ""),
        "mode": mode,
        "update_mode": spec.get("rollout", {}).get("update_mode", ""),
        "training": training_kind(spec),
    }


def training_kind(spec: dict) -> str:
    """What a run trains: "full model", or its LoRA adapter (rank, modules, shared engines)."""
    lora = (spec.get("model") or {}).get("lora")
    if not lora:
        return "full model"
    modules = lora.get("target_modules")
    shared = ((spec.get("rollout") or {}).get("share_engines"))
    return (f"LoRA r={lora.get('rank', 8)}" + (f" on {', '.join(modules)}" if modules else "")
            + (", shared engines" if shared else ""))


# --- a run's metrics -------------------------------------------------------------------------


def final_rewards(runs) -> dict[int, float | None]:
    rows = Run.objects.filter(pk__in=[r.pk for r in runs]).annotate(final=latest_value(REWARD_KEY))
    return dict(rows.values_list("pk", "final"))


# --- specs: display, diff, form ------------------------------------------------------------


def display_spec(run: Run) -> dict:
    """The full spec with defaults filled in, naming the dataset and reward as submitted
    (name@version) rather than the engine's file path and code."""
    spec = run.resolved_spec or run.spec
    try:
        spec = validate_spec(spec).to_dict()  # the spec's field order (jsonb keeps none)
    except SpecError:  # a spec from an older schema: shown as stored
        spec = json.loads(json.dumps(spec))
    submitted = run.spec or {}
    spec.setdefault("task", {})["dataset"] = (
        str(run.dataset_version) if run.dataset_version_id else submitted.get("task", {}).get("dataset"))
    reward = spec.setdefault("reward", {})
    reward.pop("code", None)
    reward["function"] = str(run.reward_version) if run.reward_version_id else (submitted.get("reward") or {}).get(
        "function", reward.get("function"))
    environment = spec["task"].get("environment")
    if environment and run.environment_version_id:  # its name@version, not the code it resolved to
        environment.pop("code", None)
        environment["name"] = str(run.environment_version)
    return spec


def flatten(value, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    if isinstance(value, dict) and value:
        out = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def unflatten(flat: dict) -> dict:
    """{"a.b": 1} -> {"a": {"b": 1}} (flatten's inverse)."""
    out: dict = {}
    for key, value in flat.items():
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def config_diff(runs) -> list[dict]:
    """One row per spec field across runs: {field, values, differs}."""
    flat = [flatten(display_spec(run)) for run in runs]
    fields = list(dict.fromkeys(field for spec in flat for field in spec))
    rows = []
    for field in fields:
        values = [spec.get(field) for spec in flat]
        rows.append({"field": field, "values": values,
                     "differs": len({json.dumps(v, sort_keys=True) for v in values}) > 1})
    return rows


DEFAULT_HYPERPARAMETERS = ["algorithm.lr", "algorithm.group_size", "schedule.max_staleness", "schedule.batch_prompts"]


def hyperparameters(runs, diff: list[dict]) -> dict:
    """Parallel-coordinates data: the fields that differ between the runs (or a default
    set if none does) and each run's final reward/mean."""
    fields = [row for row in diff if row["differs"] and row["field"] != "name"]
    if not fields:
        fields = [row for row in diff if row["field"] in DEFAULT_HYPERPARAMETERS]
    finals = final_rewards(runs)
    return {
        "runs": [{"id": run.pk, "name": run.name} for run in runs],
        "fields": [{"field": row["field"], "values": row["values"]} for row in fields],
        "final_reward": [finals.get(run.pk) for run in runs],
    }


def timeline(run: Run) -> list[dict]:
    events = [{"status": RunStatus.QUEUED, "at": run.created_at}]
    if run.started_at:
        events.append({"status": RunStatus.RUNNING, "at": run.started_at})
    if run.finished_at:
        events.append({"status": run.status, "at": run.finished_at})
    return events


# Required spec fields get these starting values in the form.
FORM_DEFAULTS = {"name": "add-async", "model.path": "builtin:tiny", "task.dataset": "gen:add"}
# Shown at once; every other field waits behind "More settings" in its section.
FORM_ESSENTIAL = {
    "name", "model.path", "task.dataset", "reward.function", "algorithm.loss", "algorithm.group_size", "algorithm.lr",
    "rollout.max_tokens", "rollout.update_mode", "schedule.mode", "schedule.max_staleness", "schedule.batch_prompts",
    "stop.max_steps", "stop.max_minutes", "eval.every_steps", "trainer.micro_batch_tokens", "resources.queue",
}
FORM_HIDDEN = {"reward.code"}  # user code is saved as a reward function and referenced by name


def form_field(name: str, info, initial: dict) -> dict:
    annotation = info.annotation
    optional = get_origin(annotation) is Union and type(None) in get_args(annotation)
    if get_origin(annotation) is Union:  # Optional[x]
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    # a section's field by its own name ("share"), a nested group's with the group ("long tail share")
    label = " ".join(name.split(".")[1:] if name.count(".") > 1 else name.split(".")[-1:]).replace("_", " ")
    field = {"name": name, "label": label, "help": info.description or "",
             "essential": name in FORM_ESSENTIAL}
    if get_origin(annotation) is Literal:
        choices = list(get_args(annotation))
        field.update(widget="select", type="int" if isinstance(choices[0], int) else "str", choices=choices)
    elif annotation is bool and optional:  # three states: a checkbox would always send true or false
        field.update(widget="select", type="optbool", choices=["", "true", "false"])
    elif annotation is bool:
        field.update(widget="checkbox", type="bool")
    elif annotation in (int, float):
        field.update(widget="number", type=annotation.__name__, step="1" if annotation is int else "any")
        for rule in info.metadata:
            if isinstance(rule, annotated_types.Ge):
                field["min"] = rule.ge
            elif isinstance(rule, annotated_types.Le):
                field["max"] = rule.le
    elif get_origin(annotation) in (list, dict) or _is_model(annotation):  # e.g. reward.components, report.mlflow
        field.update(widget="text", type="json")
    else:
        field.update(widget="text", type="str")
    default = FORM_DEFAULTS.get(name, info.default)
    field["default"] = "" if default is PydanticUndefined or default is None else default
    value = initial.get(name, field["default"])
    if _is_model(annotation) and name not in initial:  # a cloned run's section, flattened: whole again
        value = unflatten({k[len(name) + 1:]: v for k, v in initial.items() if k.startswith(name + ".")}) or value
    if _is_model(annotation) and isinstance(value, dict):
        value = json.dumps(value)  # {} is meaningful here (report.tensorboard: {} = on, with its defaults)
    elif field["type"] == "json" and isinstance(value, (list, dict)):
        value = json.dumps(value) if value else ""  # empty: the spec's default
    if field["type"] == "optbool" and isinstance(value, bool):
        value = "true" if value else "false"
    field["value"] = "" if value is None else value  # a cloned run's null: left empty, not "None"
    return field


def spec_form(initial: dict | None = None) -> list[dict]:
    """The run-spec form, read from workers.spec (the one validator), so the form and
    its defaults follow the spec: [{section, fields: [...]}, ...]. `initial`: flattened
    values to start from (another run's spec) instead of the defaults."""
    initial = initial or {}
    top = {"section": "run", "fields": []}
    sections = [top]
    for name, info in RunSpec.model_fields.items():
        if _is_model(info.annotation):
            sections.append({"section": name, "fields": _model_fields(name, info.annotation, initial)})
        else:
            top["fields"].append(form_field(name, info, initial))
    return sections


def _is_model(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _model_fields(prefix: str, model, initial: dict) -> list[dict]:
    """The fields of a spec section, a nested group (e.g. schedule.long_tail) as its own
    dotted fields, the way ``flatten`` names a stored spec's values."""
    out = []
    for sub, sub_info in model.model_fields.items():
        name = f"{prefix}.{sub}"
        if name in FORM_HIDDEN:
            continue
        if _is_model(sub_info.annotation):
            out += _model_fields(name, sub_info.annotation, initial)
        else:
            out.append(form_field(name, sub_info, initial))
    return out


def spec_choices(team) -> dict:
    """Suggestions for the form's dataset and reward fields."""
    datasets = DatasetVersion.objects.filter(dataset__team=team).select_related("dataset").order_by("dataset__name", "-version")
    rewards = RewardVersion.objects.filter(function__team=team).select_related("function").order_by("function__name", "-version")
    return {
        "datasets": [f"gen:{name}" for name in GENERATORS] + [str(v) for v in datasets],
        "rewards": list(BUILTIN_REWARDS) + [str(v) for v in rewards],
    }


# --- engine log ------------------------------------------------------------------------------

LOG_TAIL_LINES = 200
LOG_TAIL_CHARS = 64 * 1024


def engine_log_tail(run: Run) -> str | None:
    """The last lines of the run's engine log (written by runs.dispatch), None if none."""
    from fluxrl.runs.dispatch import log_tail, run_dir  # the dispatcher owns the log's place

    path = run_dir(run.pk) / "engine.log"
    return log_tail(path, LOG_TAIL_LINES, LOG_TAIL_CHARS) if path.exists() else None


def samples_per_step(run: Run) -> int:
    """Samples one training step consumes (batch_prompts x group_size): the compare
    page's "trained samples" axis is step x this."""
    spec = run.resolved_spec or {}
    return int(spec.get("schedule", {}).get("batch_prompts", 0)) * int(spec.get("algorithm", {}).get("group_size", 0))
