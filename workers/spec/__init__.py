"""The run spec: the one document shared by the CLI, the REST API, the dashboard form
and the worker processes. Validated here and nowhere else; unknown fields are rejected
by name (pydantic ``extra="forbid"``).

One module per section (model, task, reward, algorithm, rollout, schedule, trainer,
evaluation, resources, report), the rules that tie sections together as one table
(rules.py), RunSpec (run.py), loading and its errors (loading.py), the resolved
document the platform hands an engine (resolved.py) and a run's total work
(work.py). Every public name is importable from ``workers.spec``.

May import: workers.tasks, workers.io."""
from workers.spec.algorithm import DEFAULT_PPO_MINIBATCHES, AlgorithmSpec
from workers.spec.base import MAX_GROUP_SIZE, MAX_RUN_MINUTES, MAX_TOKENS, SPEC_VERSION, version_refusal
from workers.spec.evaluation import RESERVED_EVAL_SET_NAMES, EvalSetSpec, EvalSpec
from workers.spec.loading import SpecError, load_spec_file, validate_spec
from workers.spec.model import VLLM_LORA_RANKS, LoraSpec, ModelSpec, model_dtype
from workers.spec.report import (MlflowReport, ReportSpec, TensorBoardReport, WandbReport, check_server_uri,
                                 namespace_defaults, report_outside_namespace, report_paths_outside_run, server_origin)
from workers.spec.resources import PASSIVE_WAITS, InferenceSpec, ResourcesSpec, shares_cores
from workers.spec.resolved import RESOLVED_KIND, construct, is_resolved_document, load_resolved, resolved_document
from workers.spec.reward import RewardComponent, RewardModelSpec, RewardSpec
from workers.spec.rollout import RolloutSpec
from workers.spec.rules import RULES, Rule, RuleGroup
from workers.spec.run import RunSpec
from workers.spec.schedule import LongTailSpec, ScheduleSpec, StopSpec
from workers.spec.task import EnvironmentSpec, TaskSpec
from workers.spec.trainer import CriticSpec, PipelineSpec, TrainerSpec
from workers.spec.work import RunWork, run_work

__all__ = [
    "DEFAULT_PPO_MINIBATCHES", "MAX_GROUP_SIZE", "MAX_RUN_MINUTES", "MAX_TOKENS", "PASSIVE_WAITS",
    "RESERVED_EVAL_SET_NAMES", "RESOLVED_KIND", "RULES", "SPEC_VERSION",
    "VLLM_LORA_RANKS", "AlgorithmSpec", "CriticSpec", "EnvironmentSpec", "EvalSetSpec", "EvalSpec", "InferenceSpec",
    "LongTailSpec", "LoraSpec", "MlflowReport", "ModelSpec", "PipelineSpec", "ReportSpec", "ResourcesSpec",
    "RewardComponent", "RewardModelSpec", "RewardSpec", "RolloutSpec", "Rule", "RuleGroup", "RunSpec", "RunWork",
    "ScheduleSpec", "SpecError", "StopSpec", "TaskSpec", "TensorBoardReport", "TrainerSpec", "WandbReport",
    "check_server_uri", "construct", "is_resolved_document", "load_resolved", "load_spec_file", "model_dtype",
    "namespace_defaults", "report_outside_namespace", "report_paths_outside_run", "resolved_document", "run_work",
    "server_origin", "shares_cores", "validate_spec", "version_refusal",
]
