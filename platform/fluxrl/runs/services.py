"""Runs: submission (validate with workers.spec, resolve team references), the status
state machine, cooperative cancellation, and what workers report (samples, checkpoints)."""
from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from functools import partial
from itertools import groupby

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from fluxrl.accounts.services import revoke_run_tokens
from fluxrl.datasets import services as datasets
from fluxrl.errors import Conflict, InvalidInput, NotFound, TooLarge, field_error
from fluxrl.rewards import services as rewards
from workers.rewards import BUILTIN_REWARDS
from workers.spec import SpecError, validate_spec
from workers.tasks import GENERATORS

from . import live
from .models import TERMINAL_STATUSES, Checkpoint, Run, RunStatus, RunTag, Sample

ALLOWED_TRANSITIONS = {
    RunStatus.QUEUED: {RunStatus.STARTING, RunStatus.FAILED, RunStatus.CANCELLED},
    RunStatus.STARTING: {RunStatus.RUNNING, RunStatus.FAILED, RunStatus.CANCELLED},
    RunStatus.RUNNING: {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED},
}
TAG_PATTERN = re.compile(r"[\w.:/+-]{1,50}")
MAX_TAGS = 20


RESUMABLE_STATUSES = (RunStatus.FAILED, RunStatus.CANCELLED)


class IllegalTransition(Conflict):
    code = "illegal_transition"


class NoCheckpoint(Conflict):
    code = "no_checkpoint"


# --- submission ------------------------------------------------------------------------


def spec_errors(errors: list[dict], prefix: str = "spec") -> InvalidInput:
    fields = {f"{prefix}.{e['field']}": e["message"] for e in errors}
    return InvalidInput("; ".join(f"{k}: {v}" for k, v in fields.items()), fields=fields)


def parse_user_spec(spec_input) -> dict:
    """The submitted spec (a mapping, or YAML/JSON text) checked by workers.spec, the one
    validator: unknown fields and bad values are reported by their dotted name."""
    if isinstance(spec_input, (str, bytes)):
        spec_input = load_spec_text(spec_input)
    try:
        validate_spec(spec_input)
    except SpecError as exc:
        raise spec_errors(exc.errors) from None
    return copy.deepcopy(spec_input)


def load_spec_text(text: str | bytes, field: str = "spec") -> dict:
    """Spec text (YAML or JSON) through the API's one checked YAML loader (no anchors or
    aliases, bounded depth: an alias bomb would expand a billion-fold), or a 400 naming field."""
    from fluxrl.api.parsers import load_yaml_mapping  # not at the top: DRF settings import the parsers
    from rest_framework.exceptions import ParseError

    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    try:
        return load_yaml_mapping(text)
    except ParseError as exc:
        raise field_error(field, str(exc.detail)) from None


BUILTIN_MODELS = ("builtin:tiny",)  # model.path names the engine builds itself (workers/__main__.py)
MODEL_ROOTS_ENV = "FLUXRL_MODEL_ROOTS"
MODEL_FIELD = "spec.model.path"
_ROOT_RELATIVE = re.compile(r"[\w-][\w.-]*(/[\w.-]+)*")  # "Qwen/Qwen2-0.5B": a hub id, or a name under a model root


def model_roots() -> list[Path]:
    """Folders whose models any team may name (FLUXRL_MODEL_ROOTS, os.pathsep-separated;
    default FLUXRL_DATA_DIR/models), resolved. Read on every check, so a changed
    environment is followed without a restart."""
    configured = os.environ.get(MODEL_ROOTS_ENV)
    roots = configured.split(os.pathsep) if configured else [str(Path(settings.FLUXRL_DATA_DIR) / "models")]
    return [Path(os.path.realpath(r)) for r in roots if r.strip()]


def runs_root() -> Path:
    """Where the dispatcher keeps run folders: run_dir(id) = runs_root()/<id>."""
    return Path(settings.FLUXRL_DATA_DIR) / "runs"


def run_dir(run_id: int) -> Path:
    """A run's folder on its worker host (spec.json, engine.log, and out/)."""
    return runs_root() / str(run_id)


def run_output_dir(run_id: int) -> Path:
    """Where a run's engine writes its outputs (--out): checkpoints, final_model, metrics."""
    return run_dir(run_id) / "out"


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _own_run_output(team, real: Path) -> bool:
    runs = Path(os.path.realpath(runs_root()))
    if runs not in real.parents:
        return False
    run_id = real.relative_to(runs).parts[0]
    return (run_id.isdigit() and _inside(real, Path(os.path.realpath(run_output_dir(int(run_id)))))
            and Run.objects.filter(pk=int(run_id), team=team).exists())


def check_model_path(team, path: str) -> str:
    """The model.path a worker of `team` may load, or a 400 naming spec.model.path.

    Allowed: a built-in name (BUILTIN_MODELS); a folder under a model root (an absolute
    path, or a name relative to a root such as "Qwen/Qwen2-0.5B" when that folder exists
    there); the outputs of one of the team's own runs (run_output_dir). Never another
    team's outputs or any other folder of the worker host. Symlinks and `..` are resolved
    (os.path.realpath) before the check, and the resolved path is what is returned, for
    the engine to load: call this at submission and again at dispatch."""
    if "\0" in path:
        raise field_error(MODEL_FIELD, "a path cannot hold a NUL character")
    if path.startswith("builtin:"):
        if path not in BUILTIN_MODELS:
            raise field_error(MODEL_FIELD, f"unknown built-in model {path!r}; choose one of {list(BUILTIN_MODELS)}")
        return path
    roots = model_roots()
    where = (f"a built-in name ({', '.join(BUILTIN_MODELS)}), a folder under a model root "
             f"({', '.join(map(str, roots)) or 'none configured'}; {MODEL_ROOTS_ENV}) or the outputs of one of "
             "your team's runs")
    if not os.path.isabs(path):
        if _ROOT_RELATIVE.fullmatch(path) and ".." not in path.split("/"):
            for root in roots:
                real = Path(os.path.realpath(root / path))
                if _inside(real, root) and real.is_dir():
                    return str(real)
            raise field_error(MODEL_FIELD, f"{path!r} is not a folder under any model root, and workers do not "
                                           f"download hub models: put the model there, or give {where}")
        raise field_error(MODEL_FIELD, f"{path!r} is a relative path; give {where}")
    real = Path(os.path.realpath(path))
    if any(_inside(real, root) for root in roots) or _own_run_output(team, real):
        return str(real)
    raise field_error(MODEL_FIELD, f"{path} is not allowed: a model must be {where}")


def resolve_references(team, spec: dict):
    """(dataset_version, reward_version) named by the spec in the team; None where the
    spec names a built-in generator (gen:<name>), a built-in reward, inline code or a sum
    of components (built-ins and inline code only; workers.spec checks them)."""
    dataset_ref = spec["task"]["dataset"]
    function = (spec.get("reward") or {}).get("function", "numeric_match")
    try:
        if dataset_ref.startswith("gen:"):
            if dataset_ref[4:].partition("?")[0] not in GENERATORS:  # gen:<name>[?k=v&...]
                raise field_error("spec.task.dataset", f"unknown generator; choose one of {sorted(GENERATORS)}")
            dataset_version = None
        else:
            dataset_version = datasets.get_version(team, dataset_ref, field="spec.task.dataset")
        inline = function in ("user", "sum") or function in BUILTIN_REWARDS
        reward_version = None if inline else rewards.get_version(team, function, field="spec.reward.function")
    except NotFound as exc:  # a dangling reference is a bad spec, not a missing URL
        raise InvalidInput("; ".join(f"{f}: {exc.message}" for f in exc.fields), fields=exc.fields) from None
    return dataset_version, reward_version


def engine_spec(spec: dict, dataset_version=None, reward_version=None, model_path: str | None = None) -> dict:
    """The spec with team references replaced by what a worker can use: the dataset's
    immutable JSONL file (fields normalized to prompt/answer), the reward's code, and the
    model folder as check_model_path resolved it."""
    resolved = copy.deepcopy(spec)
    if model_path is not None:
        resolved.setdefault("model", {})["path"] = model_path
    if dataset_version is not None:
        resolved["task"].update(dataset=str(dataset_version.path), prompt_field="prompt", answer_field="answer")
    if reward_version is not None:
        resolved.setdefault("reward", {}).update(function="user", code=reward_version.code)
    try:
        return validate_spec(resolved).to_dict()
    except SpecError as exc:
        raise spec_errors(exc.errors) from None


def resolve_spec(run: Run) -> dict:
    """Engine-ready spec of a run, from its spec and pinned versions (paths computed now,
    so a moved FLUXRL_DATA_DIR is followed). Use this at dispatch time. The model path is
    checked again (a spec stored before the rule, or a symlink swapped after submission,
    must not slip through), and the engine is given the folder it resolved to."""
    model_path = check_model_path(run.team, (run.spec.get("model") or {}).get("path", ""))
    return engine_spec(run.spec, run.dataset_version, run.reward_version, model_path=model_path)


def clean_tags(tags) -> list[str]:
    tags = list(dict.fromkeys(str(t).strip() for t in tags or []))
    bad = [t for t in tags if not TAG_PATTERN.fullmatch(t)]
    if bad or len(tags) > MAX_TAGS:
        raise field_error("tags", f"at most {MAX_TAGS} tags of letters, digits and . : / + - _ (bad: {bad})")
    return tags


def set_tags(run: Run, tags) -> None:
    tags = clean_tags(tags)
    run.tags.exclude(name__in=tags).delete()
    RunTag.objects.bulk_create([RunTag(run=run, name=t) for t in tags], ignore_conflicts=True)


@transaction.atomic
def submit_run(team, owner, spec_input, tags=(), notes: str = "") -> Run:
    """Validate and store a run as queued. The submitted spec is kept as is; the dataset
    and reward versions it names are pinned, so later uploads do not change the run."""
    spec = parse_user_spec(spec_input)
    model_path = check_model_path(team, spec["model"]["path"])
    dataset_version, reward_version = resolve_references(team, spec)
    run = Run.objects.create(
        team=team, owner=owner, name=spec["name"], spec=spec, notes=notes,
        resolved_spec=engine_spec(spec, dataset_version, reward_version, model_path=model_path),
        dataset_version=dataset_version, reward_version=reward_version,
    )
    set_tags(run, tags)
    transaction.on_commit(partial(enqueue_run, run))  # after commit, so the worker finds the row
    return run


def enqueue_run(run: Run) -> None:
    """Hand a queued run to a Celery worker on the queue its spec asks for (cpu | gpu); a
    run over several nodes is one task per node: node 0 runs the coordinator, each other
    one a node agent that joins it (dispatch.join_run)."""
    from .tasks import execute_run, join_run  # tasks -> dispatch -> this module

    resources = run.resolved_spec["resources"]
    execute_run.apply_async((run.pk,), queue=resources["queue"])
    for node_rank in range(1, int(resources.get("nodes", 1))):
        join_run.apply_async((run.pk, node_rank), queue=resources["queue"])


def update_run(run: Run, tags=None, notes: str | None = None) -> Run:
    with transaction.atomic():
        if tags is not None:
            set_tags(run, tags)
        if notes is not None:
            run.notes = notes
            run.save(update_fields=["notes", "updated_at"])
    return run


def filter_runs(runs: QuerySet, status: str = "", tag: str = "", owner: str = "", q: str = "", team: str = "") -> QuerySet:
    if status:
        runs = runs.filter(status__in=status.split(","))
    if tag:
        runs = runs.filter(tags__name=tag)
    if owner:
        runs = runs.filter(owner__username=owner)
    if team:
        runs = runs.filter(team__slug=team)
    if q:
        runs = runs.filter(Q(name__icontains=q) | Q(notes__icontains=q))
    return runs.distinct() if tag else runs


# --- lifecycle -----------------------------------------------------------------------------


@transaction.atomic
def transition(run: Run, status: str, *, failure_reason: str = "", worker_host: str | None = None,
               worker_pid: int | None = None, rendezvous: str | None = None,
               resumed_from_step: int | None = None) -> Run:
    """Move a run along queued -> starting -> running -> succeeded/failed/cancelled
    (any live state may fail or be cancelled; a failure after a cancel request counts as
    cancelled). Reporting the current status again is a heartbeat. Reaching a terminal
    state revokes the run's tokens. Raises IllegalTransition (HTTP 409) for any other move.
    ``resumed_from_step``: sent by an engine started with --resume as it starts running;
    the points and samples after that step are dropped (prune_after), as it computes them again."""
    run = Run.objects.select_for_update().get(pk=run.pk)
    now = timezone.now()
    if status == RunStatus.FAILED and run.cancel_requested:
        status = RunStatus.CANCELLED  # an engine stopped on request may report the interruption as a failure
    if status != run.status:
        if status not in ALLOWED_TRANSITIONS.get(run.status, ()):
            raise IllegalTransition(f"A run cannot go from {run.status} to {status}.",
                                    fields={"status": f"not allowed from {run.status}"})
        if status == RunStatus.RUNNING and resumed_from_step is not None:
            # Only as it starts running: a later report of the same step must not drop
            # the points the resumed engine has sent since.
            prune_after(run, resumed_from_step)
        run.status = status
        if status == RunStatus.RUNNING:
            run.started_at = now
        if status in TERMINAL_STATUSES:
            run.finished_at = now
            run.failure_reason = failure_reason if status == RunStatus.FAILED else ""
    if not run.is_terminal:
        run.heartbeat_at = now
    if worker_host is not None:
        run.worker_host = worker_host
    if worker_pid is not None:
        run.worker_pid = worker_pid
    if rendezvous is not None:
        run.rendezvous = rendezvous
    run.save()
    if run.is_terminal:
        revoke_run_tokens(run)
    transaction.on_commit(partial(live.publish_status, run))
    return run


@transaction.atomic
def cancel_run(run: Run) -> Run:
    """Ask a run to stop: a queued run is cancelled at once; a starting or running one
    gets cancel_requested, which its worker sees in each status reply, and stops."""
    run = Run.objects.select_for_update().get(pk=run.pk)
    if run.is_terminal:
        raise IllegalTransition(f"The run has already {run.status}.")
    run.cancel_requested = True
    run.save(update_fields=["cancel_requested", "updated_at"])
    if run.status == RunStatus.QUEUED:
        return transition(run, RunStatus.CANCELLED)
    transaction.on_commit(partial(live.publish_status, run))
    return run


@transaction.atomic
def resume_run(run: Run) -> Run:
    """Queue a failed or cancelled run again, to continue from its newest checkpoint: the
    dispatcher starts the engine with --resume on the same output folder, and the engine
    loads the newest complete checkpoint it finds there. Nothing is removed here: the
    newest checkpoint on disk may be newer than the newest reported one (its report
    failed), so the points and samples after the step the engine says it resumed from
    are removed when it starts running (transition's resumed_from_step). Raises
    IllegalTransition or NoCheckpoint (HTTP 409) otherwise."""
    run = Run.objects.select_for_update().get(pk=run.pk)
    if run.status not in RESUMABLE_STATUSES:
        raise IllegalTransition(f"Only a failed or cancelled run can be resumed; run {run.pk} is {run.status}.",
                                fields={"status": f"not resumable while {run.status}"})
    checkpoint = run.checkpoints.order_by("-step").first()
    if checkpoint is None:
        raise NoCheckpoint(f"Run {run.pk} has no checkpoint to resume from: it saves one every "
                           "trainer.checkpoint_every steps of its spec (0 = only at the end), and none was saved "
                           "before it stopped.")
    run.status = RunStatus.QUEUED
    run.failure_reason = ""
    run.cancel_requested = False
    run.finished_at = run.heartbeat_at = None
    run.save()
    transaction.on_commit(partial(enqueue_run, run))
    transaction.on_commit(partial(live.publish_status, run))
    return run


def prune_after(run: Run, step: int) -> tuple[int, int]:
    """Drop the run's metric points and samples after ``step`` (a resumed engine computes
    those steps again; -1: all of them); returns how many (points, samples)."""
    from fluxrl.metrics.models import MetricPoint

    points, _ = MetricPoint.objects.filter(run=run, step__gt=step).delete()
    samples, _ = run.samples.filter(step__gt=step).delete()
    return points, samples


def resume_from_checkpoint(run: Run) -> bool:
    """Whether the dispatcher starts this run's engine with --resume: it has reported a
    checkpoint (only a run queued again by resume_run can have one when it starts)."""
    return run.checkpoints.exists()


# --- what workers report ------------------------------------------------------------------


def compress_versions(versions: list[int]) -> list[list[int]]:
    """Per-token policy versions -> [[version, count], ...]: [3, 3, 4] -> [[3, 2], [4, 1]]."""
    return [[version, len(list(group))] for version, group in groupby(versions)]


def add_samples(run: Run, samples: list[dict]) -> int:
    """Store validated samples ({step, prompt, completion, reward, versions, tokens,
    length, error, uid}); samples whose uid is already stored are skipped (retried batches)."""
    if len(samples) > settings.FLUXRL_INGEST_MAX_SAMPLES:
        raise TooLarge(f"{len(samples)} samples in one batch; the limit is {settings.FLUXRL_INGEST_MAX_SAMPLES}.")
    rows = []
    for item in samples:
        versions = item.get("versions") or []
        length = item.get("length")
        rows.append(Sample(
            run=run, uid=item.get("uid"), step=item["step"], prompt=item["prompt"], completion=item["completion"],
            reward=item.get("reward"), version_runs=compress_versions(versions), tokens=item.get("tokens"),
            error=item.get("error") or "",
            length=length if length is not None else len(versions),
        ))
    Sample.objects.bulk_create(rows, ignore_conflicts=True)
    live.publish_samples(run, rows)
    return len(rows)


def add_checkpoint(run: Run, step: int, version: int, path: str) -> Checkpoint:
    """Record a saved checkpoint; reporting the same step again returns the first record."""
    checkpoint, _ = Checkpoint.objects.get_or_create(run=run, step=step, defaults={"version": version, "path": path})
    return checkpoint
