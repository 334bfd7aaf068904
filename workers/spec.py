"""The run spec: the one document shared by the CLI, the REST API, the dashboard form
and the worker processes. Validated here and nowhere else; unknown fields are rejected
by name (pydantic ``extra="forbid"``)."""
from __future__ import annotations

from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class SpecError(ValueError):
    """A run spec that cannot run. ``errors`` is a list of {"field": "a.b", "message": ...}."""

    def __init__(self, errors: list[dict[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{e['field']}: {e['message']}" for e in errors))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSpec(_Strict):
    path: str = Field(description="local HF model folder (or hub id on a cluster)")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class TaskSpec(_Strict):
    # A JSONL file path, or a built-in generator "gen:<name>" (see workers.tasks.GENERATORS).
    dataset: str
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    size: int = Field(4000, ge=1, description="rows to generate for gen: datasets")
    eval_size: int = Field(200, ge=0, description="held-out rows (taken out of training)")
    seed: int = 0


class RewardSpec(_Strict):
    # A built-in name (workers.rewards.BUILTIN_REWARDS) or "user" with ``code``.
    function: str = "numeric_match"
    code: Optional[str] = Field(None, description="user Python defining reward(prompt, completion, **fields)")
    timeout_s: float = Field(2.0, gt=0, le=60)
    memory_mb: int = Field(512, ge=64, le=8192)

    @model_validator(mode="after")
    def _code_for_user(self):
        if self.function == "user" and not self.code:
            raise ValueError("reward.function 'user' needs reward.code")
        return self


class AlgorithmSpec(_Strict):
    loss: Literal["ppo", "reinforce"] = "ppo"
    group_size: int = Field(8, ge=1)
    lr: float = Field(5e-5, gt=0)
    warmup_steps: int = Field(10, ge=0, description="linear learning-rate warm-up: Adam's first steps "
                              "are sign-like and move every weight by the full lr, a jolt that costs reward")
    clip: float = Field(0.2, gt=0)
    kl_coef: float = Field(0.0, ge=0)
    behav_weight_cap: float = Field(5.0, gt=0)
    normalize: Literal["tokens", "batch"] = "tokens"
    adv_std_norm: bool = False
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)


class RolloutSpec(_Strict):
    engines: int = Field(1, ge=1, le=64)
    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0)
    # keep: pause with KV cache, load, resume (PipelineRL in-flight update)
    # interrupt: abort, load, resubmit prompt+prefix (AReaL)
    # drain: let running requests finish before loading (update between requests)
    update_mode: Literal["keep", "interrupt", "drain"] = "keep"
    max_num_seqs: int = Field(256, ge=1)
    # score each sample the moment it finishes, overlapped with generation (RLHFuse's
    # inter-stage fusion); off = score the whole batch after generation, at a barrier
    fused_scoring: bool = True
    migrate_tail: int = Field(0, ge=0, description="sync mode with 2+ engines: once this few requests remain, "
                              "move some from the busiest engine to the idlest (RLHFuse); 0 = off")
    kv_cache_gb: float = Field(1.0, gt=0)
    rpc_timeout_s: float = Field(60.0, gt=0, description="a weight update an engine has not acknowledged after this "
                                 "long fails the run (a wedged engine) instead of hanging it")


class ScheduleSpec(_Strict):
    mode: Literal["sync", "async"] = "async"
    max_staleness: int = Field(2, ge=0)
    batch_prompts: int = Field(8, ge=1, description="prompts per training step (x group_size samples)")
    # fifo | random | longest_first (StreamRL's skewness-aware dispatch, predicted by an
    # output-length ranker learned online from the run's own samples)
    dispatch: Literal["fifo", "random", "longest_first"] = "fifo"
    # sync mode only: train on each prompt group as soon as it is scored, overlapping the
    # first micro-batches with the tail of generation (StreamRL's stream generation)
    stream_train: bool = False


class TrainerSpec(_Strict):
    zero_stage: Literal[0, 1, 2, 3] = 0
    micro_batch_tokens: int = Field(4096, ge=16)
    checkpoint_every: int = Field(0, ge=0, description="steps between checkpoints; 0 = only at the end")


class StopSpec(_Strict):
    max_steps: int = Field(200, ge=1)
    max_minutes: float = Field(10.0, gt=0)


class EvalSpec(_Strict):
    every_steps: int = Field(20, ge=0, description="0 = only before and after")
    prompts: int = Field(200, ge=0)


class ResourcesSpec(_Strict):
    queue: Literal["cpu", "gpu"] = "cpu"
    gpus: int = Field(0, ge=0)


class RunSpec(_Strict):
    name: str = Field(min_length=1, max_length=200)
    model: ModelSpec
    task: TaskSpec
    reward: RewardSpec = RewardSpec()
    algorithm: AlgorithmSpec = AlgorithmSpec()
    rollout: RolloutSpec = RolloutSpec()
    schedule: ScheduleSpec = ScheduleSpec()
    trainer: TrainerSpec = TrainerSpec()
    stop: StopSpec = StopSpec()
    eval: EvalSpec = EvalSpec()
    resources: ResourcesSpec = ResourcesSpec()
    seed: int = 0

    @model_validator(mode="after")
    def _stream_needs_exact_scaling(self):
        if self.schedule.stream_train and self.schedule.mode != "sync":
            raise ValueError("schedule.stream_train applies to schedule.mode 'sync' (async mode streams already)")
        if self.schedule.stream_train and self.trainer.zero_stage > 0:
            # the step's token count is known only at the end; gradients are rescaled then,
            # which needs them unpartitioned
            raise ValueError("schedule.stream_train needs trainer.zero_stage 0")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def validate_spec(data: Any) -> RunSpec:
    """Validate a dict (or YAML/JSON text) into a RunSpec, or raise SpecError naming fields."""
    if isinstance(data, (str, bytes)):
        try:
            data = yaml.safe_load(data)
        except yaml.YAMLError as exc:
            raise SpecError([{"field": "(document)", "message": f"not valid YAML/JSON: {exc}"}]) from None
    if not isinstance(data, dict):
        raise SpecError([{"field": "(document)", "message": "a run spec must be a mapping"}])
    try:
        return RunSpec.model_validate(data)
    except ValidationError as exc:
        errors = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "(document)"
            msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
            errors.append({"field": field, "message": msg})
        raise SpecError(errors) from None


def load_spec_file(path: str) -> RunSpec:
    with open(path, encoding="utf-8") as fh:
        return validate_spec(fh.read())
