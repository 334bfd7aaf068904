"""What a run's engine is given: the model folder it may load (check_model_path), its
engine-ready spec (engine_spec, resolve_spec) and its folders on the worker host (run_dir,
run_output_dir). The spec is validated once, at submission (services); dispatch (dispatch)
checks the model folders again and computes the pinned files' paths anew. Both import this
module and not each other."""
from __future__ import annotations

import copy
import os
import re
from pathlib import Path

from django.conf import settings

from fluxrl.datasets.models import DatasetVersion
from fluxrl.errors import InvalidInput, NotFound, field_error
from fluxrl.modelstore import services as modelstore
from fluxrl.modelstore.models import StoredModelVersion
from fluxrl.versioned import parse_ref
from workers.models.preflight import BUILTIN_MODELS  # model.path names the engine builds itself
from workers.spec import RunSpec, SpecError, validate_spec
from workers.tasks.builtin_rewards import BUILTIN_REWARDS

from .models import Run


def spec_errors(errors: list[dict], prefix: str = "spec") -> InvalidInput:
    fields = {f"{prefix}.{e['field']}": e["message"] for e in errors}
    return InvalidInput("; ".join(f"{k}: {v}" for k, v in fields.items()), fields=fields)


BUILTIN_REWARD_MODELS = ("builtin:tiny-rm",)  # reward.model.path (workers/models/reward_model.py)
MODEL_ROOTS_ENV = "FLUXRL_MODEL_ROOTS"
MODEL_FIELD = "spec.model.path"
REWARD_MODEL_FIELD = "spec.reward.model.path"
LORA_INIT_FIELD = "spec.model.lora.init"
STORED_PREFIX = "model:"  # model:<name>[@<version>]: a folder the team uploaded (POST /api/models/)
CAUSAL_LM, CLASSIFIER = StoredModelVersion.Kind.CAUSAL_LM, StoredModelVersion.Kind.SEQUENCE_CLASSIFICATION
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


def stored_model_version(team, path: str, field: str = MODEL_FIELD, kind: str = CAUSAL_LM):
    """The team's uploaded model version that ``model:<name>[@<version>]`` names, which
    must be of ``kind`` (a causal LM for model.path, a classifier for reward.model.path),
    or a 400 naming ``field``; None for any other path."""
    if not isinstance(path, str) or not path.startswith(STORED_PREFIX):
        return None
    try:
        version = modelstore.get_version(team, path[len(STORED_PREFIX):], field=field)
    except NotFound as exc:  # a dangling reference is a bad spec, not a missing URL
        raise InvalidInput("; ".join(f"{f}: {exc.message}" for f in exc.fields), fields=exc.fields) from None
    if version.kind != kind:
        raise field_error(field, f"{path} is a {version.architecture} ({version.kind}); {field.removeprefix('spec.')} "
                                 f"needs a {kind} model")
    return version


def check_model_path(team, path: str, field: str = MODEL_FIELD, builtins: tuple[str, ...] = BUILTIN_MODELS,
                     kind: str = CAUSAL_LM) -> str:
    """The model.path (or another model folder the spec names, as ``field``) a worker of
    `team` may load, or a 400 naming ``field``.

    Allowed: a built-in name (``builtins``); ``model:<name>[@<version>]``, a folder the
    team uploaded (of ``kind``); a folder under a model root (an absolute
    path, or a name relative to a root such as "Qwen/Qwen2-0.5B" when that folder exists
    there); the outputs of one of the team's own runs (run_output_dir). Never another
    team's outputs or any other folder of the worker host. Symlinks and `..` are resolved
    (os.path.realpath) before the check, and the resolved path is what is returned, for
    the engine to load: call this at submission and again at dispatch."""
    if "\0" in path:
        raise field_error(field, "a path cannot hold a NUL character")
    if path.startswith("builtin:"):
        if path not in builtins:
            raise field_error(field, f"unknown built-in model {path!r}; choose one of {list(builtins)}")
        return path
    stored = stored_model_version(team, path, field, kind)
    if stored is not None:
        return os.path.realpath(stored.path)
    roots = model_roots()
    where = (f"a built-in name ({', '.join(builtins)}), model:<name> (a folder your team uploaded), a folder under "
             f"a model root "
             f"({', '.join(map(str, roots)) or 'none configured'}; {MODEL_ROOTS_ENV}) or the outputs of one of "
             "your team's runs")
    if not os.path.isabs(path):
        if _ROOT_RELATIVE.fullmatch(path) and ".." not in path.split("/"):
            for root in roots:
                real = Path(os.path.realpath(root / path))
                if _inside(real, root) and real.is_dir():
                    return str(real)
            raise field_error(field, f"{path!r} is not a folder under any model root, and workers do not "
                                     f"download hub models: put the model there, or give {where}")
        raise field_error(field, f"{path!r} is a relative path; give {where}")
    real = Path(os.path.realpath(path))
    if any(_inside(real, root) for root in roots) or _own_run_output(team, real):
        return str(real)
    raise field_error(field, f"{path} is not allowed: a model must be {where}")


def check_reward_model_path(team, spec: dict) -> str | None:
    """reward.model.path scoped as model.path is (check_model_path), or None without a
    reward model."""
    reward_model = (spec.get("reward") or {}).get("model")
    if not isinstance(reward_model, dict) or not isinstance(reward_model.get("path"), str):
        return None  # absent, or malformed: validate_spec names it
    return check_model_path(team, reward_model["path"], REWARD_MODEL_FIELD, BUILTIN_REWARD_MODELS, CLASSIFIER)


def check_lora_init(team, spec: dict) -> str | None:
    """model.lora.init (a run starting from an adapter folder) scoped as model.path is
    (check_model_path: the team's own run outputs or a model root, never another team's), or
    None without one."""
    lora = (spec.get("model") or {}).get("lora")
    if not isinstance(lora, dict) or not isinstance(lora.get("init"), str):
        return None
    return check_model_path(team, lora["init"], LORA_INIT_FIELD, builtins=())


def engine_spec(spec: dict | RunSpec, dataset_version=None, reward_version=None, model_path: str | None = None,
                reward_model_path: str | None = None, eval_sets: list | None = None,
                lora_init: str | None = None, environment_version=None) -> dict:
    """The spec with team references replaced by what a worker can use (substitute_references).
    A RunSpec, validated by the caller, is not validated again; a mapping is validated here
    first, the one validation of a caller that holds only the submitted mapping."""
    if not isinstance(spec, RunSpec):
        try:
            spec = validate_spec(spec)
        except SpecError as exc:
            raise spec_errors(exc.errors) from None
    return substitute_references(spec.to_dict(), dataset_version, reward_version, model_path, reward_model_path,
                                 eval_sets, lora_init, environment_version)


def substitute_references(resolved: dict, dataset_version=None, reward_version=None, model_path: str | None = None,
                          reward_model_path: str | None = None, eval_sets: list | None = None,
                          lora_init: str | None = None, environment_version=None) -> dict:
    """A validated spec (``RunSpec.to_dict()``, every section present) with the team's
    references replaced, in place: the dataset's immutable JSONL file (fields normalized to
    prompt/answer), the reward's code, the team environment's code (task.environment becomes
    name 'user' with that code, which the engine runs only in its sandbox), and the model
    folder as check_model_path resolved it. ``eval_sets``: for each of eval.sets, (its team
    dataset version or None, its team reward function's code or None). What is written in is
    the platform's own (paths it computed, code it parsed at upload), so the spec is not
    validated again."""
    for one, (set_dataset, set_code) in zip(((resolved.get("eval") or {}).get("sets") or []), eval_sets or []):
        if set_dataset is not None:
            one.update(dataset=str(set_dataset.path), prompt_field="prompt", answer_field="answer")
        if set_code is not None:
            one["reward"].update(function="user", code=set_code)
    if model_path is not None:
        resolved["model"]["path"] = model_path
    if reward_model_path is not None:
        resolved["reward"]["model"]["path"] = reward_model_path
    if lora_init is not None:
        resolved["model"]["lora"]["init"] = lora_init
    if dataset_version is not None:
        resolved["task"].update(dataset=str(dataset_version.path), prompt_field="prompt", answer_field="answer")
    if reward_version is not None:
        resolved["reward"].update(function="user", code=reward_version.code)
    if environment_version is not None:
        resolved["task"]["environment"].update(name="user", code=environment_version.code)
    return resolved


def resolve_spec(run: Run) -> dict:
    """Engine-ready spec of a run at dispatch: the spec validated and resolved at submission
    (run.resolved_spec), with the pinned versions' paths computed again (a moved
    FLUXRL_DATA_DIR is followed). The model references are checked again against the model
    roots, from the spec as submitted (a spec stored before a rule, or a symlink swapped
    after submission, must not slip through); the spec itself is not validated again: the engine receives it as a resolved
    document (workers.spec.resolved) and refuses one of another schema version."""
    stored = copy.deepcopy(run.resolved_spec)
    # an uploaded model's version was pinned at submission; anything else is checked again from
    # the reference as submitted (the model roots may have moved; a model: adapter is found again)
    if run.model_version is not None:
        model_path = os.path.realpath(run.model_version.path)
    else:
        model_path = check_model_path(run.team, (run.spec.get("model") or {}).get("path", ""))
    if run.reward_model_version is not None:
        reward_model_path = os.path.realpath(run.reward_model_version.path)
    else:
        reward_model_path = check_reward_model_path(run.team, run.spec)
    return substitute_references(stored, run.dataset_version, run.reward_version, model_path=model_path,
                                 reward_model_path=reward_model_path, eval_sets=pinned_eval_sets(run),
                                 lora_init=check_lora_init(run.team, run.spec),
                                 environment_version=run.environment_version)


def team_reward_function(function) -> bool:
    """Whether a reward section's function names a team function (name[@version]), not a
    built-in, inline code, a sum of components or the reward model."""
    return isinstance(function, str) and function not in ("user", "sum", "model") and function not in BUILTIN_REWARDS


def team_eval_dataset(ref) -> bool:
    """Whether an eval set's dataset names a team dataset (not the run's held-out split, nor a generator)."""
    return isinstance(ref, str) and not ref.startswith("gen:")


def pinned_eval_sets(run: Run) -> list[tuple]:
    """eval.sets' team datasets and reward functions as pinned at submission: the dataset
    version whose file the stored resolved spec names (its path computed again now), the
    reward code it holds. Only the team's own versions are looked at."""
    sets = ((run.spec or {}).get("eval") or {}).get("sets") or []
    stored = ((run.resolved_spec or {}).get("eval") or {}).get("sets") or []
    pinned = []
    for i, (one, kept) in enumerate(zip(sets, stored)):
        field = f"spec.eval.sets.{i}.dataset"
        dataset_version = None
        if team_eval_dataset(one.get("dataset")):
            name, _ = parse_ref(one["dataset"], field)
            versions = DatasetVersion.objects.filter(dataset__team=run.team, dataset__name=name).select_related("dataset")
            dataset_version = next((v for v in versions if str(kept.get("dataset", "")).endswith("/" + v.file)), None)
            if dataset_version is None:
                raise field_error(field, f"the dataset version pinned at submission is gone from team '{run.team.slug}'")
        function = (one.get("reward") or {}).get("function")
        code = (kept.get("reward") or {}).get("code") if team_reward_function(function) else None
        pinned.append((dataset_version, code))
    return pinned
