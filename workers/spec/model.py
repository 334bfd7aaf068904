"""The ``model`` section: the policy's folder, its precision and an optional LoRA adapter."""
from __future__ import annotations

import functools
from typing import Annotated, Literal, Optional, Protocol

from pydantic import Field

from workers.spec.base import _Strict

# vLLM's accepted max_lora_rank values (vllm/config/lora.py MaxLoRARanks): an engine serves
# adapters up to the smallest of these at or above model.lora.rank
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraSpec(_Strict):
    """LoRA RL (docs/guides/lora.md): PEFT's low-rank adapter on the policy; only the adapter
    trains, and each weight update sends only the adapter, which vLLM serves as a LoRA."""
    rank: int = Field(8, ge=1, le=512, description="the adapter's rank r")
    alpha: float = Field(16.0, gt=0, description="scaling: the update is (alpha / rank) x B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input (off in every RL "
                           "forward: the trainer runs the policy in eval mode so its ratios carry no noise)")
    target_modules: Optional[list[Annotated[str, Field(min_length=1, max_length=100)]]] = Field(
        None, min_length=1, max_length=64, description="the linear layers that get an adapter, by name (e.g. "
        "[q_proj, k_proj, v_proj, o_proj]); default: PEFT's choice for the architecture")
    init: Optional[str] = Field(None, max_length=4096, description="start from this adapter instead of B = 0: a "
                                "PEFT folder (adapter_config.json, adapter_model.safetensors), e.g. a finished "
                                "run's final_model/adapter; its rank, alpha and target_modules must be these")


class ModelSpec(_Strict):
    path: str = Field(description="local HF model folder (or hub id on a cluster)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the precision it trains and generates in; auto: bfloat16 where the run's GPUs have "
        "it, float32 on the CPU (decided on the machine that runs it: model_dtype)")
    lora: Optional[LoraSpec] = Field(None, description="train a LoRA adapter instead of the full model "
                                     "(absent: full fine-tuning)")


class _HasModel(Protocol):
    """A run spec, as far as model_dtype reads it (run.py's RunSpec)."""
    @property
    def model(self) -> ModelSpec: ...


def model_dtype(spec: _HasModel, on_gpu: Optional[bool] = None) -> str:
    """``model.dtype`` with ``auto`` decided: bfloat16 on a GPU that has it, float32 on the
    CPU. ``on_gpu``: for a plan made for GPUs (the planner), else this machine's devices."""
    if spec.model.dtype != "auto":
        return spec.model.dtype
    if on_gpu is None:
        return _auto_dtype()
    return "bfloat16" if on_gpu else "float32"


@functools.cache
def _auto_dtype() -> str:
    import torch

    return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
