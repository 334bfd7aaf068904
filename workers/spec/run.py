"""RunSpec: the whole run spec, its sections (one module each) and the rules between them."""
from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from workers.spec.algorithm import DEFAULT_PPO_MINIBATCHES, AlgorithmSpec
from workers.spec.base import SPEC_VERSION, _Strict, version_refusal
from workers.spec.evaluation import EvalSpec
from workers.spec.model import ModelSpec
from workers.spec.report import ReportSpec
from workers.spec.resources import InferenceSpec, ResourcesSpec
from workers.spec.reward import RewardSpec
from workers.spec.rollout import RolloutSpec
from workers.spec.rules import refusal
from workers.spec.schedule import ScheduleSpec, StopSpec
from workers.spec.task import TaskSpec
from workers.spec.trainer import CriticSpec, TrainerSpec


class RunSpec(_Strict):
    version: int = Field(SPEC_VERSION, description="the spec schema version it is written for; FluxRL reads "
                         f"{SPEC_VERSION} (the default) and refuses any other with the reason")
    name: str = Field(min_length=1, max_length=200)
    model: ModelSpec
    task: TaskSpec
    reward: RewardSpec = RewardSpec()
    algorithm: AlgorithmSpec = AlgorithmSpec()
    rollout: RolloutSpec = RolloutSpec()
    schedule: ScheduleSpec = ScheduleSpec()
    trainer: TrainerSpec = TrainerSpec()
    critic: CriticSpec = CriticSpec()
    inference: InferenceSpec = InferenceSpec()
    stop: StopSpec = StopSpec()
    eval: EvalSpec = EvalSpec()
    resources: ResourcesSpec = ResourcesSpec()
    report: ReportSpec = Field(ReportSpec(), description="metric exporters: TensorBoard, MLflow, W&B")
    seed: int = 0

    @field_validator("version")
    @classmethod
    def _this_version(cls, value):
        refusal = version_refusal(value)
        if refusal is not None:
            raise ValueError(refusal)
        return value

    @model_validator(mode="after")
    def _defaults_from_other_sections(self):
        # algorithm.minibatches left out depends on the loss, the schedule and the trainer;
        # filled in before the rules, which read it
        if self.algorithm.minibatches is None:
            one = self.algorithm.loss != "ppo" or self.schedule.stream_train or self.trainer.pipeline.stages > 1
            self.algorithm.minibatches = 1 if one else DEFAULT_PPO_MINIBATCHES
        return self

    @model_validator(mode="after")
    def _rules_between_sections(self):
        message = refusal(self)  # rules.py: the first group of rules the spec breaks
        if message is not None:
            raise ValueError(message)
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
