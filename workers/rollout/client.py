"""The client of a rollout engine server (server.py), over the typed protocol of
messages.py.

:class:`EngineClient` has ``RolloutEngine``'s interface, so the controller schedules
engines the same way wherever they run. It starts a server on this node
(:func:`launch_server`) or connects to one a node agent started. The client notices a
dead server within moments (its process exits or its connection closes; a remote machine
that goes silent, by the heartbeat) and then answers pending generations as
``engine_died`` (continued elsewhere from the prompt) and other calls with
:class:`~workers.rollout.engine_types.EngineDied`.

A collective weight update needs every engine at a barrier: the client holds it, and
answers the server's ``ArrivedEvent`` with a ``GoRequest``.

The engine interface is here; the requests, the reply reader and the heartbeat under it
are in client_rpc.py (:class:`~workers.rollout.client_rpc.EngineRPC`).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Optional

from workers.io import wire
from workers.io.lifetime import file_view, launcher_env
from workers.rollout.client_rpc import EngineRPC
from workers.rollout.engine import RolloutEngine
from workers.rollout.engine_args import asleep_after_wake
from workers.rollout.engine_types import Completion, UpdateTiming
from workers.rollout.messages import (REPLIES, ChecksumRequest, EngineServerConfig, GenerateRequest, GroupRequest,
                                      HandOffRequest, JoinGroupRequest, PoolView, ShutdownRequest, SleepRequest,
                                      StartRequest, TenantInfo, UpdateRequest, WakeRequest, WeightChunkRequest,
                                      WeightsAttached, WeightsByBroadcast, WeightsByPath, WeightsByStream,
                                      WireWeights)
from workers.weights.files import WeightFile, read_chunks
from workers.weights.update import BroadcastWeights, FileWeights, InlineWeights, WeightUpdate

if TYPE_CHECKING:
    from workers.weights.update import Barrier

log = logging.getLogger(__name__)

_request_ids = itertools.count(1)
BY_PATH_ENV = "FLUXRL_WEIGHTS_BY_PATH"  # "0": every update over the wire, even to a server on this host


class EngineClient(EngineRPC):
    """``RolloutEngine``'s interface for an engine server. ``address=None`` starts the
    server here (a child process in a session of its own, so its vLLM core goes with it);
    otherwise it connects to one a node agent started."""

    def __init__(self, config: EngineServerConfig, address: Optional[str] = None, pid: Optional[int] = None):
        self.config = config
        self.index, self.update_mode = config.index, config.update_mode
        self.max_model_len = config.max_model_len  # an episode's turns fit the server's context
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
        self.same_files = False  # known once the server is ready
        self._busy_s, self._running, self._stats_at = 0.0, False, time.perf_counter()
        self._core_dead = False
        self._gone: Optional[str] = None  # why the server is considered dead
        self._pending: dict[int, tuple[asyncio.Future, object]] = {}
        self._streams: dict[int, asyncio.Queue] = {}  # group request id -> its samples as they come
        self._weights: dict[int, "Barrier"] = {}  # collective updates in flight: their barriers
        self._last_heard = time.monotonic()
        self._closing = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.key: Optional[bytes] = None  # the wire key (None: the run's); a shared pool's is the node's
        self.tenant: Optional[TenantInfo] = None  # on a shared engine pool: this run
        self.pool: Optional[PoolView] = None  # on a shared engine pool: the newest view of it

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, weights: Optional[WeightUpdate] = None, version: int = 0) -> None:
        self._loop = asyncio.get_running_loop()
        if self.address is None:
            self.address, self.server_pid = await asyncio.to_thread(self._launch)
        self.channel = await asyncio.to_thread(self._connect)
        self._last_heard = time.monotonic()
        threading.Thread(target=self._read, name=f"engine-client-{self.index}", daemon=True).start()
        if isinstance(weights, BroadcastWeights):
            raise ValueError("an engine starts with a file or bytes; a broadcast needs the weight group it joins after")
        if isinstance(weights, FileWeights):  # in chunks: the server's file view is not known yet
            stream = await self._send_file(weights.file)
            ready = await self._request(StartRequest(id=next(_request_ids), version=version, weights_stream=stream,
                                                     tenant=self.tenant), timed=False)
        else:
            ready = await self._request(StartRequest(id=next(_request_ids), version=version, tenant=self.tenant),
                                        weights.data if weights is not None else None, timed=False)
        self._core_pids, self.worker_count = list(ready.core_pids), ready.worker_count
        # a server that sees this process's files takes weight files by their path (no wire, no spool)
        self.same_files = (bool(ready.file_view) and ready.file_view == file_view()
                           and os.environ.get(BY_PATH_ENV, "1") != "0")
        threading.Thread(target=self._beat, name=f"engine-heartbeat-{self.index}", daemon=True).start()
        log.info("rollout engine %d serving at %s (pid %s)", self.index, self.address, self.server_pid)

    def _launch(self) -> tuple[str, int]:
        self.proc, address, pid = launch_server(self.config)
        return address, pid

    def _connect(self) -> wire.Channel:
        """The server's connection (from a worker thread): over its local socket when it is on
        this host (wire.connect)."""
        return wire.connect(wire.parse_address(self.address), REPLIES, self.key)

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

    on_busy = RolloutEngine.on_busy  # as RolloutEngine's: a request starts on an idle engine, its last stops

    def _sent(self, key) -> None:
        if not self.active and self.on_busy is not None:
            self.on_busy(True)
        self.active[key] = time.perf_counter()

    def _ended(self, key) -> None:
        if self.active.pop(key, None) is not None and not self.active and self.on_busy is not None:
            self.on_busy(False)

    @property
    def busy_s(self) -> float:
        return self._busy_s

    # -- calls ---------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float,
                       seed: Optional[int] = None, ignore_eos: bool = False, priority: int = 0) -> Completion:
        request = GenerateRequest(id=next(_request_ids), prompt_ids=list(prompt_ids), max_tokens=max_tokens,
                                  temperature=temperature, seed=seed, ignore_eos=ignore_eos, priority=priority)
        self._sent(request.id)
        try:
            reply = await self._request(request, timed=False)
        finally:
            self._ended(request.id)
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
            self._sent(key)
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
                self._ended(keys[index])
                yield index, comp
            for i in sorted(set(range(n)) - received):
                yield i, self._died_unstarted(prompt_ids)
        finally:
            self._streams.pop(request.id, None)
            for key in keys:
                self._ended(key)
            if not ending.done() and len(received) < n:
                ending.cancel()  # the consumer stopped early: the server stops too (CancelRequest)
            elif not ending.done():  # every sample is in: the closing reply is on its way, no cancel
                ending.add_done_callback(lambda t: t.cancelled() or t.exception())
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
        left = asleep_after_wake(self.asleep, tags)
        seconds = float((await self._request(WakeRequest(id=next(_request_ids), tags=tags))).value)
        self.asleep = left
        return seconds

    async def update_weights(self, weights: WeightUpdate, version: int) -> UpdateTiming:
        """The update on the wire: a file by its path to a server that sees this host's
        files, else in bounded chunks; bytes attached; a broadcast's metadata (this client
        holds its barrier for the server: ``ArrivedEvent``, ``GoRequest``)."""
        rid = next(_request_ids)
        blob = None
        if isinstance(weights, FileWeights) and self.same_files:
            wire_weights: WireWeights = WeightsByPath(path=weights.file.path)
        elif isinstance(weights, FileWeights):
            wire_weights = WeightsByStream(stream=await self._send_file(weights.file))
        elif isinstance(weights, InlineWeights):
            wire_weights, blob = WeightsAttached(), weights.data
        else:
            wire_weights = WeightsByBroadcast(meta=weights.group.meta)
            self._weights[rid] = weights.group
        try:
            reply = await self._request(UpdateRequest(id=rid, version=version, weights=wire_weights), blob,
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
