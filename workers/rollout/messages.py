"""The typed protocol between a rollout engine server (server.py) and its client
(client.py): the server's configuration, the requests and replies (pydantic messages on
the run's TLS wire: workers/io/wire.py), and what a shared engine pool's tenant is
(workers/rollout/pool.py).

A collective weight update (workers/weights/broadcast.py) needs every engine at a barrier before
the trainer sends: the server asks the client to ``arrive`` for it (``ArrivedEvent``)
and receives only after the client's ``GoRequest``.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, TypeAdapter, field_validator

from workers.io import wire

# What the plan sets (workers/cluster/placement.py: OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES, VLLM_CPU_OMP_THREADS_BIND;
# rollout.py: VLLM_CPU_KVCACHE_SPACE): an engine server sets nothing else from a message
# (LD_PRELOAD, PYTHONPATH, ... would run code of the sender's choosing).
ENV_ALLOWED = ("CUDA_VISIBLE_DEVICES", "OMP_*", "VLLM_CPU_*")


def env_allowed(key: str) -> bool:
    return any(key.startswith(p[:-1]) if p.endswith("*") else key == p for p in ENV_ALLOWED)


# The engine protocol's version: a new message or a change of a message's shape raises it. A
# shared engine pool outlives the runs that started it, so a pool is found only by runs of its
# own version (pool_registry.pool_id hashes it).
PROTOCOL_VERSION = 3

# -- configuration and messages ----------------------------------------------------------
class EngineServerConfig(wire.Message):
    model_path: str
    index: int
    update_mode: Literal["keep", "interrupt", "drain"] = "keep"
    max_model_len: int = 256
    max_num_seqs: int = 256
    dtype: str = "float32"
    seed: int = 0
    rpc_timeout_s: float = 60.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = []
    stop_token_ids: list[int] = []
    kv_cache_gb: float = 1.0
    gpu_memory_utilization: Optional[float] = None
    host: str = "127.0.0.1"  # the address it listens on (a node's reachable address for remote clients)
    env: dict[str, str] = {}  # the plan's placement: CUDA_VISIBLE_DEVICES, VLLM_CPU_OMP_THREADS_BIND, ...
    cpu_single_process: bool = False  # rollout.cpu_single_process
    enforce_eager: Optional[bool] = None  # rollout.enforce_eager (None: eager on the CPU, CUDA graphs on GPUs)
    sleep_mode: bool = False  # colocated GPU plans: asleep while the trainer steps
    tensor_parallel: int = Field(1, ge=1, le=64)  # shards (vLLM workers) of this engine
    priority_scheduling: bool = False  # vLLM's priority scheduler (schedule.dispatch skew_aware)
    lora_rank: Optional[int] = Field(None, ge=1, le=512)  # model.lora: serve the policy's adapter as a vLLM LoRA
    heartbeat_timeout_s: float = 30.0  # a remote server this long silent is dead (a busy machine is not)
    accept_timeout_s: float = 900.0  # for its client to connect (a node agent starts its trainer ranks first)

    @field_validator("env")
    @classmethod
    def _env_allowed(cls, env: dict[str, str]) -> dict[str, str]:
        refused = sorted(k for k in env if not env_allowed(k))
        if refused:
            raise ValueError(f"an engine server may not set {', '.join(refused)} (allowed: {', '.join(ENV_ALLOWED)})")
        return env


class TenantInfo(wire.Message):
    """Who a run on a shared engine pool is (workers/rollout/pool.py), and what of the
    engine is its own: the sampling settings and update mode its requests use."""
    run: str = Field(max_length=200)  # shown to the same team's runs only
    team: str = Field(max_length=100)  # believed only on a pool without a verifier (no platform on the node)
    ticket: Optional[str] = Field(None, max_length=2000)  # the platform's signed tenant and weight (tickets.py)
    group_size: int = Field(1, ge=1)  # algorithm.group_size: at most the pool's seats
    lora_rank: int = Field(ge=1, le=512)
    update_mode: Literal["keep", "interrupt"] = "keep"
    top_p: float = 1.0
    top_k: int = -1
    stop: list[Annotated[str, Field(max_length=200)]] = Field([], max_length=16)
    stop_token_ids: list[int] = Field([], max_length=256)


class StartRequest(wire.Message):
    kind: Literal["start"] = "start"
    id: int
    version: int = 0  # with warm weights: their version (a resumed run)
    weights_stream: Optional[int] = None  # the warm weights: a stream of WeightChunkRequests sent before
    tenant: Optional[TenantInfo] = None  # on a shared engine pool: the run joining it


class WeightChunkRequest(wire.Message):
    """A piece of a safetensors file (workers/weights/files.py), ``offset`` bytes in, of a
    file of ``total`` bytes; the blob is the piece. No reply: the update or start that
    names the stream answers for it (an error in a chunk is raised there)."""
    kind: Literal["weight_chunk"] = "weight_chunk"
    id: int  # the stream
    offset: int = Field(ge=0)
    total: int = Field(ge=0)


class GenerateRequest(wire.Message):
    kind: Literal["generate"] = "generate"
    id: int
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: Optional[int] = None
    ignore_eos: bool = False
    priority: int = 0  # its place in vLLM's queue (smaller first), with priority scheduling


class GroupRequest(wire.Message):
    """``n`` samples of one prompt as one vLLM request: a ``SampleReply`` as each finishes,
    then a ``ValueReply`` (the count) that ends the stream."""
    kind: Literal["group"] = "group"
    id: int
    prompt_ids: list[int]
    n: int
    max_tokens: int
    temperature: float
    seed: Optional[int] = None
    ignore_eos: bool = False
    priority: int = 0  # its place in vLLM's queue (smaller first), with priority scheduling


class HandOffRequest(wire.Message):
    kind: Literal["hand_off"] = "hand_off"
    id: int
    count: int


class WeightsByPath(wire.Message):
    """The trainer's weight file itself, where the server sees the same files
    (``ReadyReply.file_view``; the server checks the file is its user's, in a folder no one
    else may enter: files.local_weight_file)."""
    how: Literal["path"] = "path"
    path: str = Field(max_length=4096)


class WeightsByStream(wire.Message):
    """A file sent before as a stream of WeightChunkRequests (its id), spooled by the server."""
    how: Literal["stream"] = "stream"
    stream: int


class WeightsAttached(wire.Message):
    """Safetensors bytes attached to the request's frame."""
    how: Literal["attached"] = "attached"


class WeightsByBroadcast(wire.Message):
    """A collective broadcast: the metadata each engine's receive needs."""
    how: Literal["broadcast"] = "broadcast"
    meta: dict[str, Any]


WireWeights = Annotated[Union[WeightsByPath, WeightsByStream, WeightsAttached, WeightsByBroadcast],
                        Field(discriminator="how")]


class UpdateRequest(wire.Message):
    """New weights labelled ``version``, and how they travel: the wire's form of the
    weight-update descriptor (workers/weights/update.py), told apart once by the server."""
    kind: Literal["update"] = "update"
    id: int
    version: int
    weights: WireWeights


class GoRequest(wire.Message):
    """Every engine arrived at the collective update ``id``'s barrier (or it failed)."""
    kind: Literal["go"] = "go"
    id: int
    failure: Optional[str] = None


class JoinGroupRequest(wire.Message):
    kind: Literal["join_group"] = "join_group"
    id: int
    info: dict[str, Any]


class ChecksumRequest(wire.Message):
    kind: Literal["checksum"] = "checksum"
    id: int


class SleepRequest(wire.Message):
    """Colocated plans: free the engine's GPU memory (vLLM sleep level 1)."""
    kind: Literal["sleep"] = "sleep"
    id: int


class WakeRequest(wire.Message):
    """Wake ``tags`` (vLLM's: "weights", "kv_cache"), or all of it."""
    kind: Literal["wake"] = "wake"
    id: int
    tags: Optional[list[Literal["weights", "kv_cache"]]] = None


class CancelRequest(wire.Message):
    """Stop generation request ``id``: its caller gave up on it (a timed-out evaluation). No
    reply; the engine aborts the request's sequences. Any other kind of request runs on."""
    kind: Literal["cancel"] = "cancel"
    id: int


class PingRequest(wire.Message):
    kind: Literal["ping"] = "ping"
    id: int = 0


class ShutdownRequest(wire.Message):
    kind: Literal["shutdown"] = "shutdown"
    id: int = 0


EngineRequest = Annotated[
    Union[StartRequest, GenerateRequest, GroupRequest, HandOffRequest, UpdateRequest, WeightChunkRequest, GoRequest,
          JoinGroupRequest, ChecksumRequest, SleepRequest, WakeRequest, PingRequest, ShutdownRequest, CancelRequest],
    Field(discriminator="kind"),
]


class PoolView(wire.Message):
    """A run's view of the shared engine pool it is on: nothing of the other runs but
    how many there are and the share of generation this one got and is due."""
    id: str
    slot: int
    slots: int
    runs: int  # on the pool now, this one included
    teams: int
    share: float  # of the tokens the pool generated over the last window
    fair_share: float  # what its team's weight entitles it to while every run is busy


class EngineStats(wire.Message):
    generated_tokens: int = 0
    busy_s: float = 0.0  # up to the moment of sending, the running stretch included
    running: bool = False
    version: int = 0
    dead: bool = False  # the vLLM core process died
    stalls: dict[int, float] = {}  # update version -> generation stall (ms), measured since the last report
    pool: Optional[PoolView] = None  # on a shared engine pool


class WireCompletion(wire.Message):
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[tuple[int, int]]  # (version, tokens) runs
    finish_reason: str
    start_version: int
    started_at: float
    finished_at: float
    resubmits: int
    engine: int


class ReadyReply(wire.Message):
    kind: Literal["ready"] = "ready"
    id: int
    pid: int
    core_pids: list[int]
    worker_count: int
    stats: EngineStats
    file_view: str = Field("", max_length=256)  # lifetime.file_view(): "" takes every update by the wire


class CompletionReply(wire.Message):
    kind: Literal["completion"] = "completion"
    id: int
    completion: WireCompletion
    stats: EngineStats


class SampleReply(wire.Message):
    """One finished sample of a ``GroupRequest`` (its place in the group: ``index``)."""
    kind: Literal["sample"] = "sample"
    id: int
    index: int
    completion: WireCompletion
    stats: EngineStats


class UpdatedReply(wire.Message):
    kind: Literal["updated"] = "updated"
    id: int
    version: int
    sync_ms: float
    load_ms: float
    stats: EngineStats


class ValueReply(wire.Message):
    kind: Literal["value"] = "value"
    id: int
    value: Union[int, float, str, None, list[int]]
    stats: EngineStats


class ArrivedEvent(wire.Message):
    kind: Literal["arrived"] = "arrived"
    id: int


class ErrorReply(wire.Message):
    kind: Literal["error"] = "error"
    id: int
    error_type: str
    message: str
    stats: EngineStats


class PongReply(wire.Message):
    kind: Literal["pong"] = "pong"
    id: int = 0
    stats: EngineStats


EngineReply = Annotated[
    Union[ReadyReply, CompletionReply, SampleReply, UpdatedReply, ValueReply, ArrivedEvent, ErrorReply, PongReply],
    Field(discriminator="kind"),
]

REQUESTS: TypeAdapter[EngineRequest] = TypeAdapter(EngineRequest)
REPLIES: TypeAdapter[EngineReply] = TypeAdapter(EngineReply)
