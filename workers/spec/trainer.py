"""The ``trainer`` section (with its ``pipeline``) and the ``critic`` of a GAE run."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from workers.spec.base import _Strict


class PipelineSpec(_Strict):
    """RLHFuse's intra-stage fusion as the trainer of a GAE run (workers/train/pipeline_trainer.py)."""
    stages: int = Field(1, ge=1, le=16, description="pipeline stages the actor and the critic are split into by "
                        "layers, one rank process each, the critic's stages in the opposite direction; 1 = no "
                        "pipeline (DeepSpeed's trainer)")
    schedule: Literal["fused", "sequential"] = Field(
        "fused", description="fused: both models' micro-batches in one schedule, each filling the other's "
        "bubbles; sequential: the actor's 1F1B pipeline, then the critic's")
    micro_batches: int = Field(8, ge=1, le=512, description="micro-batches per step (by length)")


class TrainerSpec(_Strict):
    zero_stage: Literal[0, 1, 2, 3] = 0
    micro_batch_tokens: int = Field(4096, ge=16)
    gradient_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in the "
                                         "backward instead of keeping them (Hugging Face's gradient "
                                         "checkpointing): less memory, about one forward more per step")
    checkpoint_every: int = Field(0, ge=0, description="steps between checkpoints; 0 = only at the end")
    pipeline: PipelineSpec = PipelineSpec()


class CriticSpec(_Strict):
    """The value model of algorithm.advantage 'gae': the policy's own model folder with a scalar
    head (initialised to 0) in place of the LM head, trained by its own DeepSpeed engine."""
    lr: Optional[float] = Field(None, gt=0, description="default: algorithm.lr")
    value_clip: float = Field(0.2, gt=0, description="how far one batch may move a value from the one its "
                              "advantages were computed with (PPO's clipped value loss)")
    zero_stage: Literal[0, 1, 2, 3] = 0
    forward: Literal["trainer", "stage"] = Field(
        "trainer", description="where the critic's no-grad forward (the values GAE is computed from) runs: inside "
        "the trainer's step, or in the inference stage, a worker process holding a copy of the critic that "
        "values each sample as it finishes generating (inference.*); the copy is reloaded after every step")
