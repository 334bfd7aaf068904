"""A rollout engine in a process of its own, on any node, served over a typed protocol.

``python -m workers engine-server`` (started by :class:`EngineClient` on this node, or by
a node agent on another: workers/cluster/node.py) reads an :class:`EngineServerConfig` as JSON
on stdin, sets the environment the plan gives it (``CUDA_VISIBLE_DEVICES``, vLLM's CPU
core binding; only the families in :data:`ENV_ALLOWED`) before vLLM loads, listens on a port
(the run's TLS wire: workers/io/wire.py), prints that address as its first
line of stdout, and serves one client: the run's coordinator. It wraps the same
:class:`~workers.rollout.engine.RolloutEngine` the in-process mode uses, so generation, the
update modes (keep / interrupt / drain), per-token versions and the generation-stall
measurement are the same code.

:class:`EngineClient` has ``RolloutEngine``'s interface, so the controller schedules
engines the same way wherever they run. The client notices a dead server within
moments (its process exits or its connection closes; a remote machine that goes silent,
by the heartbeat) and then answers
pending generations as ``engine_died`` (continued elsewhere from the prompt) and other
calls with :class:`EngineDied`.

A collective weight update (weight_broadcast.py) needs every engine at a barrier before
the trainer sends: the server asks the client to ``arrive`` for it (``ArrivedEvent``)
and receives only after the client's ``GoRequest``.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Annotated, Literal, Optional, Union

from pydantic import Field, TypeAdapter, field_validator

from workers.io import wire
from workers.io.lifetime import exit_with_parent, launcher_env
from workers.rollout.engine import (Completion, EngineDied, EngineRPCTimeout, RolloutEngine, SamplingOptions, UpdateTiming,
                      configure_cpu_environment)
from workers.rollout.staleness import VersionTrack
from workers.weights.files import WeightFile, WeightSpool, read_chunks

if TYPE_CHECKING:
    from workers.weights.broadcast import CollectiveWeights

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0

# What the plan sets (workers/cluster/placement.py: OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES, VLLM_CPU_OMP_THREADS_BIND;
# rollout.py: VLLM_CPU_KVCACHE_SPACE): an engine server sets nothing else from a message
# (LD_PRELOAD, PYTHONPATH, ... would run code of the sender's choosing).
ENV_ALLOWED = ("CUDA_VISIBLE_DEVICES", "OMP_*", "VLLM_CPU_*")


def env_allowed(key: str) -> bool:
    return any(key.startswith(p[:-1]) if p.endswith("*") else key == p for p in ENV_ALLOWED)


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
    team: str = Field(max_length=100)
    weight: float = Field(1.0, gt=0, le=1000)  # the team's share weight (the operator's, not the spec's)
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


class UpdateRequest(wire.Message):
    """New weights labelled ``version``: a stream of WeightChunkRequests sent before
    (``weights_stream``), a safetensors blob attached, or the metadata of a collective
    broadcast."""
    kind: Literal["update"] = "update"
    id: int
    version: int
    collective_meta: Optional[dict] = None
    weights_stream: Optional[int] = None


class GoRequest(wire.Message):
    """Every engine arrived at the collective update ``id``'s barrier (or it failed)."""
    kind: Literal["go"] = "go"
    id: int
    failure: Optional[str] = None


class JoinGroupRequest(wire.Message):
    kind: Literal["join_group"] = "join_group"
    id: int
    info: dict


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


class PingRequest(wire.Message):
    kind: Literal["ping"] = "ping"
    id: int = 0


class ShutdownRequest(wire.Message):
    kind: Literal["shutdown"] = "shutdown"
    id: int = 0


EngineRequest = Annotated[
    Union[StartRequest, GenerateRequest, GroupRequest, HandOffRequest, UpdateRequest, WeightChunkRequest, GoRequest,
          JoinGroupRequest, ChecksumRequest, SleepRequest, WakeRequest, PingRequest, ShutdownRequest],
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

REQUESTS: TypeAdapter = TypeAdapter(EngineRequest)
REPLIES: TypeAdapter = TypeAdapter(EngineReply)


def _to_wire(c: Completion) -> WireCompletion:
    return WireCompletion(prompt_ids=c.prompt_ids, token_ids=c.token_ids, logprobs=c.logprobs,
                          versions=[(int(v), int(n)) for v, n in c.versions.runs], finish_reason=c.finish_reason,
                          start_version=c.start_version, started_at=c.started_at, finished_at=c.finished_at,
                          resubmits=c.resubmits, engine=c.engine)


def _from_wire(w: WireCompletion) -> Completion:
    track = VersionTrack()
    for version, n in w.versions:
        track.add(version, n)
    return Completion(list(w.prompt_ids), list(w.token_ids), list(w.logprobs), track, w.finish_reason,
                      w.start_version, w.started_at, w.finished_at, w.resubmits, w.engine)


# -- the server ---------------------------------------------------------------------------
class _RemoteWeights:
    """The server's view of a collective update: the metadata, and a barrier that is the
    client's (which holds the real one for every engine)."""

    def __init__(self, meta: dict, arrive):
        self.meta = meta
        self._arrive = arrive

    async def arrive(self) -> None:
        await self._arrive()


CLIENT_GONE_GRACE_S = 5.0  # how long a server whose client is gone may take to stop by itself


class _Server:
    """Serves one client. ``engine``: a run's view of a shared pool's engine
    (workers/rollout/pool.py), which outlives this connection; by default an engine of its
    own, and the process exits with its client (``standalone``)."""

    def __init__(self, config: EngineServerConfig, channel: wire.Channel, engine: Optional[RolloutEngine] = None,
                 standalone: bool = True):
        self.config, self.channel, self.standalone = config, channel, standalone
        self.engine = engine or RolloutEngine(
            config.model_path, index=config.index, update_mode=config.update_mode, max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs, dtype=config.dtype, seed=config.seed, rpc_timeout_s=config.rpc_timeout_s,
            sampling=SamplingOptions(config.top_p, config.top_k, tuple(config.stop), tuple(config.stop_token_ids)),
            gpu_memory_utilization=config.gpu_memory_utilization, cpu_single_process=config.cpu_single_process,
            enforce_eager=config.enforce_eager, sleep_mode=config.sleep_mode, tensor_parallel=config.tensor_parallel,
            priority_scheduling=config.priority_scheduling, lora_rank=config.lora_rank)
        self.started = False
        self.stop = asyncio.Event()
        self.tasks: set[asyncio.Task] = set()
        self.go: dict[int, asyncio.Future] = {}
        # weights sent in chunks land on disk, capped by the model folder's size
        self.spool = WeightSpool.for_model(config.model_path)

    def stats(self) -> EngineStats:
        e = self.engine
        now = time.perf_counter()
        stalls = {}
        for u in list(e.updates):
            if u.gen_stall_ms is not None:
                stalls[u.version] = u.gen_stall_ms
                e.updates.remove(u)
            elif u.version < e.version - 1:  # its requests finished before a stall could be seen
                e.updates.remove(u)
        return EngineStats(generated_tokens=e.generated_tokens, busy_s=e.busy_seconds(now), running=bool(e.active),
                           version=e.version, dead=self.started and e.dead, stalls=stalls, pool=self.pool_view())

    def pool_view(self) -> Optional[PoolView]:
        return None

    def pong(self) -> None:
        """From the reader thread: the heartbeat does not wait for the event loop."""
        self.channel.send(PongReply(stats=EngineStats(generated_tokens=self.engine.generated_tokens,
                                                      version=self.engine.version,
                                                      dead=self.started and self.engine.dead)))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()

        def read() -> None:
            try:
                while True:
                    request, blob = self.channel.recv()
                    if isinstance(request, PingRequest):
                        self.pong()
                        continue
                    if isinstance(request, WeightChunkRequest):  # in order, off the event loop
                        self.spool.write(request.id, request.offset, request.total, blob or b"")
                        continue
                    loop.call_soon_threadsafe(self.dispatch, request, blob)
            except EOFError:  # the client is gone: so is the reason to run
                pass
            except Exception as exc:  # noqa: BLE001 - a broken connection (closed by now) ends the server too
                log.error("engine %d: the connection failed: %s: %s", self.config.index, type(exc).__name__, exc)
            loop.call_soon_threadsafe(self.stop.set)
            if not self.standalone:  # a pool's connection: the pool goes on
                return
            # The loop may be busy for a while (vLLM's start-up runs on it when vLLM is inside
            # this process): with no client left, the server must not outlive it by more than a
            # moment, nor leave its session (vLLM's processes) behind. A normal exit comes first.
            time.sleep(CLIENT_GONE_GRACE_S)
            log.warning("engine %d: its client is gone and it did not stop within %g s: exiting",
                        self.config.index, CLIENT_GONE_GRACE_S)
            if os.getpgrp() == os.getpid():  # a session of its own (launch_server): take it all
                os.killpg(os.getpid(), signal.SIGKILL)
            os._exit(1)

        threading.Thread(target=read, name="engine-server-reader", daemon=True).start()
        await self.stop.wait()
        for task in list(self.tasks):
            task.cancel()
        await self.close_engine()
        self.spool.close()

    async def close_engine(self) -> None:
        self.engine.shutdown()

    def dispatch(self, request, blob: Optional[bytes]) -> None:
        if isinstance(request, ShutdownRequest):
            self.stop.set()
            return
        if isinstance(request, GoRequest):
            future = self.go.pop(request.id, None)
            if future is not None and not future.done():
                future.set_result(request.failure)
            return
        task = asyncio.ensure_future(self.handle(request, blob))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def handle(self, request, blob: Optional[bytes]) -> None:
        try:
            reply = await self._handle(request, blob)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            log.debug("engine %d: %s failed", self.config.index, request.kind, exc_info=True)
            reply = ErrorReply(id=request.id, error_type=type(exc).__name__, message=str(exc), stats=self.stats())
        try:
            self.channel.send(reply)
        except OSError:
            self.stop.set()

    async def _handle(self, request, blob: Optional[bytes]):
        e = self.engine
        if isinstance(request, StartRequest):
            warm = self.spool.take(request.weights_stream) if request.weights_stream is not None else blob
            try:
                await e.start(warm_blob=warm, version=request.version)
            finally:
                if isinstance(warm, WeightFile):
                    self.spool.release(warm)
            self.started = True
            return ReadyReply(id=request.id, pid=os.getpid(), core_pids=e.core_pids(), worker_count=e.worker_count,
                              stats=self.stats())
        if isinstance(request, GenerateRequest):
            c = await e.generate(request.prompt_ids, request.max_tokens, request.temperature, seed=request.seed,
                                 ignore_eos=request.ignore_eos, priority=request.priority)
            return CompletionReply(id=request.id, completion=_to_wire(c), stats=self.stats())
        if isinstance(request, GroupRequest):
            sent = 0
            async with contextlib.aclosing(e.stream_group(request.prompt_ids, request.n, request.max_tokens,
                                                          request.temperature, seed=request.seed,
                                                          ignore_eos=request.ignore_eos,
                                                          priority=request.priority)) as samples:
                async for index, c in samples:
                    self.channel.send(SampleReply(id=request.id, index=index, completion=_to_wire(c),
                                                  stats=self.stats()))
                    sent += 1
            return ValueReply(id=request.id, value=sent, stats=self.stats())
        if isinstance(request, UpdateRequest):
            if request.collective_meta is not None:
                weights = _RemoteWeights(request.collective_meta, lambda: self._arrive(request.id))
            elif request.weights_stream is not None:
                weights = self.spool.take(request.weights_stream)
            elif blob is not None:
                weights = blob
            else:
                raise ValueError("an update without weights")
            try:
                t = await e.update_weights(weights, request.version)
            finally:
                if isinstance(weights, WeightFile):
                    self.spool.release(weights)
            return UpdatedReply(id=request.id, version=t.version, sync_ms=t.sync_ms, load_ms=t.load_ms,
                                stats=self.stats())
        if isinstance(request, HandOffRequest):
            value = await e.hand_off(request.count)
        elif isinstance(request, JoinGroupRequest):
            value = await e.join_weight_group(request.info)
        elif isinstance(request, ChecksumRequest):
            value = await e.weights_checksum()
        elif isinstance(request, SleepRequest):
            value = await e.sleep()
        elif isinstance(request, WakeRequest):
            value = await e.wake_up(request.tags)
        else:
            raise TypeError(f"unexpected request {request.kind!r}")
        return ValueReply(id=request.id, value=value, stats=self.stats())

    async def _arrive(self, update_id: int) -> None:
        from workers.weights.broadcast import WeightBroadcastError

        future = asyncio.get_running_loop().create_future()
        self.go[update_id] = future
        self.channel.send(ArrivedEvent(id=update_id))
        failure = await future
        if failure is not None:
            raise WeightBroadcastError(failure)


def serve(config: EngineServerConfig) -> int:
    """The engine server's process: listen, announce the address on stdout, serve one client."""
    # Its launcher (the run's engine, or a node agent) stops it; one that was SIGKILLed cannot,
    # and the server may be waiting for a client that will never connect.
    exit_with_parent(code=1, whole_session=True)
    os.environ.update(config.env)  # before vLLM (and torch) read it; the keys are allow-listed (validated)
    configure_cpu_environment(config.env.get("VLLM_CPU_OMP_THREADS_BIND"), config.kv_cache_gb)
    listener = wire.listen(config.host, 0)
    sys.stdout.write(json.dumps({"address": wire.format_address(listener.address), "pid": os.getpid()}) + "\n")
    sys.stdout.flush()
    # only a client that holds the run's key gets here (the listener refuses the others, each
    # connection with its own handshake deadline)
    try:
        channel = listener.accept(REQUESTS, timeout=config.accept_timeout_s)
    except TimeoutError as exc:
        log.error("engine %d: %s: exiting", config.index, exc)
        return 1
    finally:
        listener.close()
    asyncio.run(_Server(config, channel).run())
    # vLLM has shut its engine core down and closed its sockets: nothing is left to flush but
    # the standard streams. Skipping the interpreter's teardown of torch and vLLM (2+ s, every
    # run's engines waited on it at close) changes nothing else.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


# -- the client -----------------------------------------------------------------------------
_request_ids = itertools.count(1)


class EngineClient:
    """``RolloutEngine``'s interface for an engine server. ``address=None`` starts the
    server here (a child process in a session of its own, so its vLLM core goes with it);
    otherwise it connects to one a node agent started."""

    def __init__(self, config: EngineServerConfig, address: Optional[str] = None, pid: Optional[int] = None):
        self.config = config
        self.index, self.update_mode = config.index, config.update_mode
        self.address, self.server_pid = address, pid
        self.proc: Optional[subprocess.Popen] = None
        self.channel: Optional[wire.Channel] = None
        self.active: dict[object, float] = {}  # one key per running sequence -> time sent
        self.updates: list[UpdateTiming] = []
        self.version = 0
        self.generated_tokens = 0
        self.worker_count = 1
        self.sleep_mode, self.asleep = config.sleep_mode, None  # as RolloutEngine's
        self._core_pids: list[int] = []
        self._busy_s, self._running, self._stats_at = 0.0, False, time.perf_counter()
        self._core_dead = False
        self._gone: Optional[str] = None  # why the server is considered dead
        self._pending: dict[int, tuple[asyncio.Future, object]] = {}
        self._streams: dict[int, asyncio.Queue] = {}  # group request id -> its samples as they come
        self._weights: dict[int, "CollectiveWeights"] = {}
        self._last_heard = time.monotonic()
        self._closing = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.key: Optional[bytes] = None  # the wire key (None: the run's); a shared pool's is the node's
        self.tenant: Optional[TenantInfo] = None  # on a shared engine pool: this run
        self.pool: Optional[PoolView] = None  # on a shared engine pool: the newest view of it

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, warm_blob: "bytes | WeightFile | None" = None, version: int = 0) -> None:
        self._loop = asyncio.get_running_loop()
        if self.address is None:
            self.address, self.server_pid = await asyncio.to_thread(self._launch)
        self.channel = await asyncio.to_thread(wire.connect, wire.parse_address(self.address), REPLIES, self.key)
        self._last_heard = time.monotonic()
        threading.Thread(target=self._read, name=f"engine-client-{self.index}", daemon=True).start()
        if isinstance(warm_blob, WeightFile):
            stream = await self._send_file(warm_blob)
            ready = await self._request(StartRequest(id=next(_request_ids), version=version, weights_stream=stream,
                                                     tenant=self.tenant), timed=False)
        else:
            ready = await self._request(StartRequest(id=next(_request_ids), version=version, tenant=self.tenant),
                                        warm_blob, timed=False)
        self._core_pids, self.worker_count = list(ready.core_pids), ready.worker_count
        threading.Thread(target=self._beat, name=f"engine-heartbeat-{self.index}", daemon=True).start()
        log.info("rollout engine %d serving at %s (pid %s)", self.index, self.address, self.server_pid)

    def _launch(self) -> tuple[str, int]:
        self.proc, address, pid = launch_server(self.config)
        return address, pid

    def request_shutdown(self) -> None:
        """Ask the server to stop, without waiting (``shutdown`` waits): several engines then
        shut down at once."""
        if self.channel is not None and self._gone is None and not self._closing:
            try:
                self.channel.send(ShutdownRequest())
            except OSError:
                pass
        self._closing = True

    def shutdown(self) -> None:
        self.request_shutdown()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
            kill_session(self.proc.pid)
            self.proc.wait()
            self.proc = None
        self._mark_gone("shut down")
        if self.channel is not None:
            self.channel.close()

    @property
    def dead(self) -> bool:
        return self._gone is not None or self._core_dead

    def core_pids(self) -> list[int]:
        return list(self._core_pids)

    def busy_seconds(self, now: Optional[float] = None) -> float:
        now = time.perf_counter() if now is None else now
        return self._busy_s + (now - self._stats_at if self._running and not self.dead else 0.0)

    @property
    def busy_s(self) -> float:
        return self._busy_s

    # -- calls ---------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float,
                       seed: Optional[int] = None, ignore_eos: bool = False, priority: int = 0) -> Completion:
        request = GenerateRequest(id=next(_request_ids), prompt_ids=list(prompt_ids), max_tokens=max_tokens,
                                  temperature=temperature, seed=seed, ignore_eos=ignore_eos, priority=priority)
        self.active[request.id] = time.perf_counter()
        try:
            reply = await self._request(request, timed=False)
        finally:
            self.active.pop(request.id, None)
        return reply

    # the in-process engine's collection, over this class's stream_group
    generate_group = RolloutEngine.generate_group

    async def stream_group(self, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                           seed: Optional[int] = None, ignore_eos: bool = False, priority: int = 0):
        """``RolloutEngine.stream_group`` on the server: ``(index, Completion)`` as each sample
        finishes there. If the server dies, the samples not yet back end as ``engine_died``
        with no tokens (the controller continues them elsewhere)."""
        request = GroupRequest(id=next(_request_ids), prompt_ids=list(prompt_ids), n=n, max_tokens=max_tokens,
                               temperature=temperature, seed=seed, ignore_eos=ignore_eos, priority=priority)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request.id] = queue
        keys = [(request.id, i) for i in range(n)]
        for key in keys:
            self.active[key] = time.perf_counter()
        ending = asyncio.ensure_future(self._request(request, timed=False))
        ending.add_done_callback(lambda _: queue.put_nowait(None))
        received: set[int] = set()
        try:
            while len(received) < n:
                item = await queue.get()
                if item is None:  # the stream's end: its count, an error, or a dead server
                    ending.result()  # raises the server's error
                    break
                index, comp = item
                received.add(index)
                self.active.pop(keys[index], None)
                yield index, comp
            for i in sorted(set(range(n)) - received):
                yield i, self._died_unstarted(prompt_ids)
        finally:
            self._streams.pop(request.id, None)
            for key in keys:
                self.active.pop(key, None)
            if not ending.done():
                ending.cancel()
            elif not ending.cancelled():
                ending.exception()  # retrieved: a consumer that stopped early does not want it

    async def hand_off(self, count: int) -> int:
        return (await self._request(HandOffRequest(id=next(_request_ids), count=count))).value

    async def join_weight_group(self, info: dict) -> list[int]:
        return (await self._request(JoinGroupRequest(id=next(_request_ids), info=info))).value

    async def weights_checksum(self) -> Optional[str]:
        return (await self._request(ChecksumRequest(id=next(_request_ids)))).value

    async def sleep(self) -> float:
        seconds = float((await self._request(SleepRequest(id=next(_request_ids)))).value)
        self.asleep = "all"
        return seconds

    async def wake_up(self, tags: Optional[list[str]] = None) -> float:
        if self.asleep is None:
            return 0.0
        seconds = float((await self._request(WakeRequest(id=next(_request_ids), tags=tags))).value)
        self.asleep = "kv_cache" if tags == ["weights"] else None
        return seconds

    async def update_weights(self, weights: "bytes | WeightFile | CollectiveWeights", version: int) -> UpdateTiming:
        rid = next(_request_ids)
        if isinstance(weights, WeightFile):
            stream = await self._send_file(weights)
            reply = await self._request(UpdateRequest(id=rid, version=version, weights_stream=stream), timed=False)
        elif isinstance(weights, (bytes, bytearray, memoryview)):
            reply = await self._request(UpdateRequest(id=rid, version=version), bytes(weights), timed=False)
        else:
            self._weights[rid] = weights
            try:
                reply = await self._request(UpdateRequest(id=rid, version=version, collective_meta=weights.meta),
                                            timed=False)
            finally:
                self._weights.pop(rid, None)
        self.version = max(self.version, reply.version)
        timing = UpdateTiming(reply.version, reply.sync_ms, reply.load_ms)
        self.updates.append(timing)
        return timing

    async def _send_file(self, weights: WeightFile) -> int:
        """Send a weight file as a stream of bounded chunks (files.chunk_bytes), off the
        event loop; its id, for the request that uses it."""
        stream = next(_request_ids)
        if self._gone is not None:
            return stream  # the request that names it fails as every call to a gone server does

        def send() -> None:
            for offset, data in read_chunks(weights.path):
                self.channel.send(WeightChunkRequest(id=stream, offset=offset, total=weights.size), data)

        try:
            await asyncio.to_thread(send)
        except OSError:
            self._mark_gone("its connection broke")
        return stream

    async def _request(self, request, blob: Optional[bytes] = None, timed: bool = True):
        """Send, await the reply (its own id), raise its error in this process's terms."""
        if self._gone is not None:
            return self._when_gone(request)
        future = asyncio.get_running_loop().create_future()
        self._pending[request.id] = (future, request)
        try:
            if blob:  # a big attachment is written off the event loop
                await asyncio.to_thread(self.channel.send, request, blob)
            else:
                self.channel.send(request)
        except OSError:
            self._pending.pop(request.id, None)
            self._mark_gone("its connection broke")
            return self._when_gone(request)
        try:
            if timed:
                return await asyncio.wait_for(asyncio.shield(future), self.config.rpc_timeout_s)
            return await future
        except asyncio.TimeoutError:
            raise EngineRPCTimeout(f"rollout engine {self.index} did not answer {request.kind} within "
                                   f"{self.config.rpc_timeout_s:g} s (rollout.rpc_timeout_s)") from None
        finally:
            self._pending.pop(request.id, None)

    def _when_gone(self, request):
        """A generation that cannot finish here ends as ``engine_died`` with no tokens (the
        controller continues it on another engine); any other call raises."""
        if isinstance(request, GroupRequest):
            return request.n  # the stream ends; its missing samples end as engine_died
        if isinstance(request, GenerateRequest):
            return self._died_unstarted(request.prompt_ids)
        raise EngineDied(f"rollout engine {self.index} died ({self._gone}) during {request.kind}")

    def _died_unstarted(self, prompt_ids: list[int]) -> Completion:
        """A generation lost with its server: no tokens back, to be redone elsewhere."""
        now = time.time()
        return Completion(list(prompt_ids), [], [], VersionTrack(), "engine_died", self.version, now, now, 0,
                          self.index)

    # -- the connection ---------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                reply, _ = self.channel.recv()
                self._last_heard = time.monotonic()
                self._loop.call_soon_threadsafe(self._on_reply, reply)
        except EOFError:
            why = "its connection closed"
        except Exception as exc:  # noqa: BLE001 - TLS error, bad or oversized frame: the channel is closed
            why = f"its connection failed ({type(exc).__name__}: {exc})"
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._mark_gone, why)

    def _on_reply(self, reply) -> None:
        stats = getattr(reply, "stats", None)
        if stats is not None:
            self._take_stats(stats, full=not isinstance(reply, PongReply))
        if isinstance(reply, ArrivedEvent):
            asyncio.ensure_future(self._arrive(reply.id))
            return
        if isinstance(reply, SampleReply):
            queue = self._streams.get(reply.id)
            if queue is not None:
                queue.put_nowait((reply.index, _from_wire(reply.completion)))
            return
        entry = self._pending.get(reply.id)
        if entry is None or entry[0].done():
            return
        future, request = entry
        if isinstance(reply, ErrorReply):
            future.set_exception(_error(reply, self.index))
        elif isinstance(reply, CompletionReply):
            future.set_result(_from_wire(reply.completion))
        else:
            future.set_result(reply)

    def _take_stats(self, stats: EngineStats, full: bool) -> None:
        self._core_dead = stats.dead
        self.generated_tokens = max(self.generated_tokens, stats.generated_tokens)
        if not full:  # a heartbeat: counters only
            return
        self._busy_s, self._running, self._stats_at = stats.busy_s, stats.running, time.perf_counter()
        self.version = max(self.version, stats.version)
        if stats.pool is not None:
            self.pool = stats.pool
        for version, ms in stats.stalls.items():
            for u in self.updates:
                if u.version == version and u.gen_stall_ms is None:
                    u.gen_stall_ms = ms

    async def _arrive(self, update_id: int) -> None:
        weights = self._weights.get(update_id)
        failure = None
        try:
            if weights is None:
                raise RuntimeError("no such update")
            await weights.arrive()
        except Exception as exc:  # noqa: BLE001 - the server's receive raises it
            failure = f"{type(exc).__name__}: {exc}"
        try:
            self.channel.send(GoRequest(id=update_id, failure=failure))
        except OSError:
            self._mark_gone("its connection broke")

    def _beat(self) -> None:
        """A thread of its own, so that a busy event loop (a long synchronous call in the
        coordinator) is not mistaken for a dead server."""
        while self._gone is None and not self._closing:
            time.sleep(HEARTBEAT_S)
            why = None
            if self.proc is not None and self.proc.poll() is not None:
                why = f"its process exited with code {self.proc.returncode}"
            elif self.proc is None and time.monotonic() - self._last_heard > self.config.heartbeat_timeout_s:
                # a remote server (a local one is watched by its process, and a dead process
                # closes the connection at once): silence means its machine or network is gone
                why = f"no heartbeat for {self.config.heartbeat_timeout_s:g} s"
            else:
                try:
                    self.channel.send(PingRequest())
                except OSError:
                    why = "its connection broke"
            if why is not None:
                if not self._closing and not self._loop.is_closed():
                    self._loop.call_soon_threadsafe(self._mark_gone, why)
                return

    def _mark_gone(self, why: str) -> None:
        if self._gone is not None:
            return
        self._gone = why
        if why != "shut down":
            log.warning("rollout engine %d (server pid %s) is gone: %s", self.index, self.server_pid, why)
        for future, request in list(self._pending.values()):
            if not future.done():
                try:
                    future.set_result(self._when_gone(request))
                except EngineDied as exc:
                    future.set_exception(exc)
        self._pending.clear()


def _error(reply: ErrorReply, index: int) -> BaseException:
    from workers.weights.broadcast import WeightBroadcastError

    known = {"EngineDied": EngineDied, "EngineRPCTimeout": EngineRPCTimeout, "WeightBroadcastError": WeightBroadcastError}
    if reply.error_type in known:
        return known[reply.error_type](reply.message)
    return RuntimeError(f"rollout engine {index}: {reply.error_type}: {reply.message}")


def launch_server(config: EngineServerConfig) -> tuple[subprocess.Popen, str, int]:
    """Start an engine server on this node (in a session of its own, so that killing the
    session takes its vLLM core too); returns the process, its address and pid."""
    wire.cluster_key()  # the child inherits the run's key through the environment
    # The plan's environment from exec on (not only once the server reads its config): what
    # a library reads at import (OpenMP's pool size) is then the plan's too, and
    # /proc/<pid>/environ shows where the process was put.
    proc = subprocess.Popen([sys.executable, "-m", "workers", "engine-server"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, **config.env, **launcher_env()},
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc.stdin.write(config.model_dump_json().encode())
    proc.stdin.close()
    line = proc.stdout.readline()
    if not line:
        code = proc.wait()
        raise RuntimeError(f"rollout engine {config.index}'s server exited with code {code} before listening")
    # vLLM may print to stdout later: keep the pipe drained, into this process's stderr
    threading.Thread(target=_forward, args=(proc.stdout,), daemon=True).start()
    announced = json.loads(line)
    return proc, announced["address"], announced["pid"]


def _forward(stream) -> None:
    for line in iter(stream.readline, b""):
        sys.stderr.write(line.decode(errors="replace"))


def kill_session(pid: int) -> None:
    """The server and everything it started (vLLM's core process)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
