"""The typed pipe protocol between a ``TrainerGroup`` (ranks.py) and its rank processes
(rank_process.py): a rank's configuration, the requests (``TrainerRequest``) and the
replies (``TrainerReply``), pydantic messages sent as plain dicts over multiprocessing pipes.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from workers.spec import RunSpec


# -- messages ------------------------------------------------------------------------
class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Sample(_Message):
    prompt_ids: list[int]
    token_ids: list[int]
    behav_logprobs: list[float]
    advantage: float
    prox_logprobs: Optional[list[float]] = None
    reward: float = 0.0  # algorithm.advantage gae: each rank's critic turns it into per-token advantages
    values: Optional[list[float]] = None  # critic.forward stage: the critic's values, from the inference stage
    ref_logprobs: Optional[list[float]] = None  # algorithm.kl_reference stage: log π_ref, from the inference stage
    versions: Optional[list[int]] = None  # the policy version of each token: the mismatch metrics' staleness
    loss_mask: Optional[list[int]] = None  # an episode: 0 on its observation tokens (never trained)
    token_rewards: Optional[list[float]] = None  # an episode under GAE: each token's reward


class StepShare(_Message):
    """One rank's part of one optimiser step."""
    samples: list[int]  # indices into the request's samples
    denominator: float  # of the whole step, over all ranks
    micro_batches: int  # the most any rank packs in this step


class TrainRequest(_Message):
    kind: Literal["train"] = "train"
    samples: list[Sample]  # every sample this rank trains on in this batch
    steps: list[StepShare]
    proximal_micro_batches: int = 0  # several steps: π_prox of ``proximal`` first, in this many forwards
    proximal: list[int] = []  # indices into ``samples``: those a step after the first trains on
    critic_micro_batches: int = 0  # gae: the critic's values of ``samples`` first, in this many forwards
    # gae: indices into ``samples`` whose advantages this rank counts in the batch's statistics
    # (whitening, critic/*): with several epochs a sample trains on more than one rank, and is
    # counted on one of them only; None counts all of ``samples``
    counted: Optional[list[int]] = None
    grad_scale: float


class BeginStepRequest(_Message):
    kind: Literal["begin_step"] = "begin_step"


class AccumulateRequest(_Message):
    kind: Literal["accumulate"] = "accumulate"
    samples: list[Sample]
    denominator: float
    last: bool
    micro_batches: int
    grad_scale: float


class FinishStepRequest(_Message):
    kind: Literal["finish_step"] = "finish_step"
    sequences: int
    rescale: bool
    denominator: Optional[float]  # of the whole streamed step over all ranks


class StateDictRequest(_Message):
    kind: Literal["state_dict"] = "state_dict"
    model: Literal["policy", "critic"] = "policy"  # critic: for the critic stage (workers/train/value_stage.py)
    path: Optional[str] = None  # rank 0 writes a safetensors file there (node 0's disk) instead of replying a blob


class SaveRequest(_Message):
    kind: Literal["save"] = "save"
    path: str


class SaveStateRequest(_Message):
    kind: Literal["save_state"] = "save_state"
    folder: str


class LoadStateRequest(_Message):
    kind: Literal["load_state"] = "load_state"
    folder: str


class ShutdownRequest(_Message):
    kind: Literal["shutdown"] = "shutdown"


# The weight group (workers/weights/broadcast.py) with global rank 0 as its rank 0: the
# weights go from the rank that gathers them straight to the engines.
class HostWeightGroupRequest(_Message):
    kind: Literal["host_weight_group"] = "host_weight_group"
    host: str
    world: int
    backend: str
    timeout_s: float


class FormWeightGroupRequest(_Message):
    kind: Literal["form_weight_group"] = "form_weight_group"


class PrepareWeightsRequest(_Message):
    kind: Literal["prepare_weights"] = "prepare_weights"  # every rank: ZeRO-3 gathers
    version: int
    bucket_bytes: int


class SendWeightsRequest(_Message):
    kind: Literal["send_weights"] = "send_weights"


class LeaveWeightGroupRequest(_Message):
    kind: Literal["leave_weight_group"] = "leave_weight_group"


TrainerRequest = Annotated[
    Union[TrainRequest, BeginStepRequest, AccumulateRequest, FinishStepRequest, StateDictRequest, SaveRequest,
          SaveStateRequest, LoadStateRequest, ShutdownRequest, HostWeightGroupRequest, FormWeightGroupRequest,
          PrepareWeightsRequest, SendWeightsRequest, LeaveWeightGroupRequest],
    Field(discriminator="kind"),
]


class ReadyReply(_Message):
    kind: Literal["ready"] = "ready"
    rank: int
    pid: int
    version: int


class DoneReply(_Message):
    kind: Literal["done"] = "done"
    rank: int
    version: int


class StatsReply(_Message):
    kind: Literal["stats"] = "stats"
    rank: int
    version: int
    stats: dict[str, Union[int, float]]  # reduced over all ranks: every rank sends the same


class StateReply(_Message):
    kind: Literal["state"] = "state"
    rank: int
    blob: Optional[bytes] = None  # safetensors bytes of the full state dict, from global rank 0 only
    checksum: Optional[str] = None  # tensors_checksum of it, computed in rank 0


class WeightGroupReply(_Message):
    """Rank 0 on the weight group. ``error``: the group failed (not the rank: it trains on)."""
    kind: Literal["weight_group"] = "weight_group"
    rank: int
    port: Optional[int] = None
    nccl_id: Optional[str] = None  # NCCL: the unique id rank 0 minted, for the engines' join RPC
    meta: Optional[dict[str, Any]] = None
    error: Optional[str] = None


class ErrorReply(_Message):
    kind: Literal["error"] = "error"
    rank: int
    error: str
    traceback: str


TrainerReply = Annotated[
    Union[ReadyReply, DoneReply, StatsReply, StateReply, WeightGroupReply, ErrorReply],
    Field(discriminator="kind"),
]

_REQUESTS: TypeAdapter[TrainerRequest] = TypeAdapter(TrainerRequest)
_REPLIES: TypeAdapter[TrainerReply] = TypeAdapter(TrainerReply)


class _RankConfig(_Message):
    spec: RunSpec
    model_path: str
    threads: Optional[int]
    pad_id: int
    rank: int
    parent_pid: int
    env: dict[str, str]
