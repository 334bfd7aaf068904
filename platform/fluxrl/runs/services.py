"""Runs: submission (validate with workers.spec, resolve team references), cooperative
cancellation, resuming, and what workers report (samples, checkpoints).

The status state machine lives in lifecycle.py and what the engine is given in
engine_inputs.py, which the worker host's dispatcher (dispatch.py) uses too. This module
sends the Celery tasks (tasks.py, which call dispatch.py) and imports them at the top;
none of those imports this module."""
from __future__ import annotations

import copy
import re
from functools import partial
from itertools import groupby

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet

from fluxrl.accounts.services import merge_report, tracker_namespace
from fluxrl.datasets import services as datasets
from fluxrl.environments import services as environments
from fluxrl.errors import Conflict, Forbidden, InvalidInput, NotFound, TooLarge, field_error
from fluxrl.quotas import services as quotas
from fluxrl.rewards import services as rewards
from fluxrl.safe_yaml import BadYAML, load_yaml_mapping
from workers.tasks.builtin_rewards import BUILTIN_REWARDS
from workers.spec import (ReportSpec, RunSpec, SpecError, namespace_defaults, report_outside_namespace,
                          report_paths_outside_run, validate_spec)
from workers.tasks.datasets import GENERATORS

from . import live, tasks
from .engine_inputs import (  # noqa: F401 - used here; some callers name them as runs.services.X
    CLASSIFIER,
    REWARD_MODEL_FIELD,
    check_lora_init,
    check_model_path,
    check_reward_model_path,
    stored_model_version,
    engine_spec,
    team_eval_dataset,
    team_reward_function,
    spec_errors,
)
from .lifecycle import (  # noqa: F401 - re-exported as above
    IllegalTransition,
    transition,
)
from .models import Checkpoint, Run, RunStatus, RunTag, Sample

TAG_PATTERN = re.compile(r"[\w.:/+-]{1,50}")
MAX_TAGS = 20


RESUMABLE_STATUSES = (RunStatus.FAILED, RunStatus.CANCELLED)


class NoCheckpoint(Conflict):
    code = "no_checkpoint"


# --- submission ------------------------------------------------------------------------


def parse_user_spec(spec_input, team=None) -> tuple[dict, RunSpec]:
    """The submitted spec (a mapping, or YAML/JSON text) as submitted and as validated by
    workers.spec, the one validator, once: unknown fields and bad values are reported by their
    dotted name. With a team, its default exporters are merged under the spec's own `report`
    first, and the tracker names it leaves out are filled in inside the team's namespace (the
    run keeps the merged section, so its spec says where its metrics went)."""
    if isinstance(spec_input, (str, bytes)):
        spec_input = load_spec_text(spec_input)
    if team is not None and team.report_defaults and isinstance(spec_input, dict):
        spec_input = {**spec_input, "report": merge_report(team.report_defaults, spec_input.get("report"))}
    try:
        validated = validate_spec(spec_input)
    except SpecError as exc:
        raise spec_errors(exc.errors) from None
    # a run writes only inside its own folder, or to an MLflow server the deployment allows
    outside = report_paths_outside_run(validated.report, settings.FLUXRL_MLFLOW_SERVERS)
    if outside:
        raise spec_errors(outside)
    if team is not None:  # and, on a tracker the teams share, only under the team's own names
        namespace = tracker_namespace(team)
        foreign = report_outside_namespace(validated.report, **namespace)
        if foreign:
            raise spec_errors(foreign)
        filled = namespace_defaults(validated.report, **namespace)
        if filled:
            spec_input = {**spec_input, "report": merge_report(spec_input["report"], filled)}
            # only the section the platform filled in is new; the rest stays as validated
            report = ReportSpec.model_validate(merge_report(validated.report.model_dump(mode="json"), filled))
            validated = validated.model_copy(update={"report": report})
    quotas.check_spec_ceilings(validated)  # the deployment's per-run engines, nodes and work
    return copy.deepcopy(spec_input), validated


def load_spec_text(text: str | bytes, field: str = "spec") -> dict:
    """Spec text (YAML or JSON) through the one checked YAML loader the API's YAML bodies
    use (fluxrl.safe_yaml: no anchors or aliases, bounded depth: an alias bomb would expand
    a billion-fold), or a 400 naming field."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    try:
        return load_yaml_mapping(text)
    except BadYAML as exc:
        raise field_error(field, str(exc)) from None


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
        inline = function in ("user", "sum", "model") or function in BUILTIN_REWARDS
        reward_version = None if inline else rewards.get_version(team, function, field="spec.reward.function")
    except NotFound as exc:  # a dangling reference is a bad spec, not a missing URL
        raise InvalidInput("; ".join(f"{f}: {exc.message}" for f in exc.fields), fields=exc.fields) from None
    return dataset_version, reward_version


ENVIRONMENT_FIELD = "spec.task.environment.name"


def resolve_environment(team, spec: dict):
    """The team environment version task.environment.name names (name@version, or the
    newest for a bare name), or None for a built-in, inline code or no environment. Only
    the team's own are found: another team's answers a 400 on the field that does not say
    whether it exists."""
    name = ((spec.get("task") or {}).get("environment") or {}).get("name")
    if not environments.is_team_reference(name):
        return None
    try:
        return environments.get_version(team, name, field=ENVIRONMENT_FIELD)
    except NotFound as exc:  # a dangling reference is a bad spec, not a missing URL
        raise InvalidInput("; ".join(f"{f}: {exc.message}" for f in exc.fields), fields=exc.fields) from None


def resolve_eval_sets(team, spec: dict) -> list[tuple]:
    """For each of eval.sets, (its team dataset version or None, its team reward
    function's code or None): the team's own, pinned now like task.dataset and
    reward.function. A set without a dataset evaluates the run's held-out split; a gen:
    generator is checked by workers.spec; a dataset or function of another team is not found."""
    pinned = []
    for i, one in enumerate(((spec.get("eval") or {}).get("sets")) or []):
        ref, function = one.get("dataset"), (one.get("reward") or {}).get("function")
        try:
            dataset_version = (datasets.get_version(team, ref, field=f"spec.eval.sets.{i}.dataset")
                               if team_eval_dataset(ref) else None)
            code = (rewards.get_version(team, function, field=f"spec.eval.sets.{i}.reward.function").code
                    if team_reward_function(function) else None)
        except NotFound as exc:  # a dangling reference is a bad spec, not a missing URL
            raise InvalidInput("; ".join(f"{f}: {exc.message}" for f in exc.fields), fields=exc.fields) from None
        pinned.append((dataset_version, code))
    return pinned


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
    """Validate and store a run as queued. The submitted spec is kept as is (with the
    team's default exporters merged into its `report`); the dataset and reward versions it
    names are pinned, so later uploads do not change the run."""
    spec, validated = parse_user_spec(spec_input, team)
    model_path = check_model_path(team, spec["model"]["path"])
    reward_model_path = check_reward_model_path(team, spec)
    dataset_version, reward_version = resolve_references(team, spec)
    environment_version = resolve_environment(team, spec)
    reward_model = (spec.get("reward") or {}).get("model") or {}
    resolved_spec = engine_spec(validated, dataset_version, reward_version, model_path=model_path,
                                reward_model_path=reward_model_path, eval_sets=resolve_eval_sets(team, spec),
                                lora_init=check_lora_init(team, spec), environment_version=environment_version)
    quotas.check_run_quota(team, resolved_spec, owner)  # locks the team's and owner's rows until stored
    run = Run.objects.create(
        team=team, owner=owner, name=spec["name"], spec=spec, notes=notes, resolved_spec=resolved_spec,
        dataset_version=dataset_version, reward_version=reward_version, environment_version=environment_version,
        model_version=stored_model_version(team, spec["model"]["path"]),
        reward_model_version=stored_model_version(team, reward_model.get("path"), REWARD_MODEL_FIELD, CLASSIFIER),
    )
    set_tags(run, tags)
    transaction.on_commit(partial(enqueue_run, run))  # after commit, so the worker finds the row
    return run


def enqueue_run(run: Run) -> None:
    """Hand a queued run to a Celery worker on the queue its spec asks for (cpu | gpu); a
    run over several nodes is one task per node: node 0 runs the coordinator, each other
    one a node agent that joins it (dispatch.join_run)."""
    resources = run.resolved_spec["resources"]
    tasks.execute_run.apply_async((run.pk,), queue=resources["queue"])
    for node_rank in range(1, int(resources.get("nodes", 1))):
        tasks.join_run.apply_async((run.pk, node_rank), queue=resources["queue"])


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


# --- cancelling and resuming (the state machine itself: lifecycle.transition) --------------


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
    quotas.check_run_quota(run.team, run.resolved_spec, run.owner)  # live again: it counts like a new run
    run.status = RunStatus.QUEUED
    run.failure_reason = ""
    run.cancel_requested = False
    run.finished_at = run.heartbeat_at = None
    run.save()
    transaction.on_commit(partial(enqueue_run, run))
    transaction.on_commit(partial(live.publish_status, run))
    return run


# --- what workers report ------------------------------------------------------------------

# What only the run's engine can know: the host and process it runs in, the shared engine
# pools it is on (other teams' run pages count the runs on a pool: a claimed pool would put a
# run on theirs that is not there), the checkpoint step it resumed after (the points and
# samples past it are dropped).
ENGINE_FIELDS = ("worker_host", "worker_pid", "engine_pools", "resumed_from_step")


def report_status(run: Run, report: dict, *, from_run_token: bool, from_dispatcher: bool = False) -> Run:
    """A status report or heartbeat (POST /api/runs/<id>/status/): report is the validated
    RunStatusReportSerializer's data. The ENGINE_FIELDS are taken only with a run token of
    this run (the key its worker reports with; the permission has matched it to the run): a
    team member's session or API token may move the status on, but a report of theirs that
    names any of them is refused whole (403), nothing of it applied. ``from_dispatcher``: the
    token is the one the platform's dispatcher minted for the engine it started, not one a
    member minted for an engine of their own: only its pools are attested (engine_sharing)."""
    report = dict(report)
    claimed = [name for name in ENGINE_FIELDS if name in report]
    if claimed and not from_run_token:
        why = "reported only by the run's engine, with the run's own run token"
        raise Forbidden(f"{', '.join(claimed)}: these describe the run's engine and are accepted only with the run's "
                        "own run token (the key its worker reports with), not a person's session or API token; "
                        "post the status without them.", fields={name: why for name in claimed})
    if "engine_pools" in report:
        report["engine_pools_attested"] = from_dispatcher
    return transition(run, report.pop("status"), **report)


def compress_versions(versions: list[int]) -> list[list[int]]:
    """Per-token policy versions -> [[version, count], ...]: [3, 3, 4] -> [[3, 2], [4, 1]]."""
    return [[version, len(list(group))] for version, group in groupby(versions)]


def add_samples(run: Run, samples: list[dict]) -> int:
    """Store validated samples ({step, prompt, completion, reward, versions, tokens,
    length, error, uid, episode}); samples whose uid is already stored are skipped (retried batches)."""
    if len(samples) > settings.FLUXRL_INGEST_MAX_SAMPLES:
        raise TooLarge(f"{len(samples)} samples in one batch; the limit is {settings.FLUXRL_INGEST_MAX_SAMPLES}.")
    rows = []
    for item in samples:
        versions = item.get("versions") or []
        length = item.get("length")
        rows.append(Sample(
            run=run, uid=item.get("uid"), step=item["step"], prompt=item["prompt"], completion=item["completion"],
            reward=item.get("reward"), version_runs=compress_versions(versions), tokens=item.get("tokens"),
            error=item.get("error") or "", episode=item.get("episode"),
            length=length if length is not None else len(versions),
        ))
    Sample.objects.bulk_create(rows, ignore_conflicts=True)
    live.publish_samples(run, rows)
    return len(rows)


def add_checkpoint(run: Run, step: int, version: int, path: str) -> Checkpoint:
    """Record a saved checkpoint; reporting the same step again returns the first record."""
    checkpoint, _ = Checkpoint.objects.get_or_create(run=run, step=step, defaults={"version": version, "path": path})
    return checkpoint


def engine_sharing(run: Run) -> list[dict]:
    """rollout.share_engines: for each shared engine pool the run is on (as its heartbeat
    last said), its measured and fair share and the other live runs on the same pool of the
    same worker host: the run's own team's by name, another team's counted only (a team
    sees nothing of another's runs but that they exist). Another team's runs count only where
    both runs' pools are attested (reported by engines the platform started): an engine a
    member started with a run token they minted says what it likes, so its claim of a pool
    may show on its own team's pages but never puts a run on another team's."""
    if not run.engine_pools:
        return []
    others = [] if run.is_terminal else list(
        Run.objects.filter(status__in=(RunStatus.STARTING, RunStatus.RUNNING), worker_host=run.worker_host)
        .exclude(pk=run.pk).exclude(engine_pools=[])
        .only("id", "name", "team_id", "engine_pools", "engine_pools_attested"))
    sharing = []
    for pool in run.engine_pools:
        on_it = [o for o in others if any(p.get("id") == pool["id"] for p in o.engine_pools)]
        sharing.append({"id": pool["id"], "share": pool.get("share"), "fair_share": pool.get("fair_share"),
                        "team_runs": [{"id": o.pk, "name": o.name} for o in on_it if o.team_id == run.team_id],
                        "other_team_runs": sum(1 for o in on_it if o.team_id != run.team_id
                                               and o.engine_pools_attested and run.engine_pools_attested)})
    return sharing
