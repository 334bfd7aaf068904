"""A rollout engine in a process of its own, on any node, served over a typed protocol
(messages.py).

``python -m workers engine-server`` (started by an :class:`~workers.rollout.client.EngineClient`
on this node, or by a node agent on another: workers/cluster/node.py) reads an
:class:`~workers.rollout.messages.EngineServerConfig` as JSON on stdin, sets the environment
the plan gives it (``CUDA_VISIBLE_DEVICES``, vLLM's CPU core binding; only the families in
:data:`~workers.rollout.messages.ENV_ALLOWED`) before vLLM loads, listens on a port
(the run's TLS wire: workers/io/wire.py), prints that address as its first
line of stdout, and serves one client: the run's coordinator. It wraps the same
:class:`~workers.rollout.engine.RolloutEngine` the in-process mode uses, so generation, the
update modes (keep / interrupt / drain), per-token versions and the generation-stall
measurement are the same code. Weights sent in chunks land in a spool on disk.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Optional

from workers.io import wire
from workers.io.lifetime import exit_with_parent, file_view
from workers.rollout.engine import RolloutEngine
from workers.rollout.engine_args import configure_cpu_environment
from workers.rollout.engine_types import Completion
from workers.rollout.messages import (REQUESTS, ArrivedEvent, CancelRequest, ChecksumRequest, CompletionReply,
                                      EngineServerConfig, EngineStats, ErrorReply, GenerateRequest, GoRequest,
                                      GroupRequest, HandOffRequest, JoinGroupRequest, PingRequest, PongReply,
                                      PoolView, ReadyReply, SampleReply, ShutdownRequest, SleepRequest, StartRequest,
                                      UpdateRequest, UpdatedReply, ValueReply, WakeRequest, WeightChunkRequest,
                                      WeightsByBroadcast, WeightsByPath, WeightsByStream, WireCompletion)
from workers.weights.files import WeightSpool, local_weight_file
from workers.weights.update import BroadcastWeights, FileWeights, InlineWeights, WeightUpdate

log = logging.getLogger(__name__)


def _to_wire(c: Completion) -> WireCompletion:
    return WireCompletion(prompt_ids=c.prompt_ids, token_ids=c.token_ids, logprobs=c.logprobs,
                          versions=[(int(v), int(n)) for v, n in c.versions.runs], finish_reason=c.finish_reason,
                          start_version=c.start_version, started_at=c.started_at, finished_at=c.finished_at,
                          resubmits=c.resubmits, engine=c.engine)


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

    # Weight files named by path (same host, same user): one run's server only. A pool serves
    # several teams' runs, and a path could name another run's file.
    TAKES_LOCAL_FILES = True

    def __init__(self, config: EngineServerConfig, channel: wire.Channel, engine: Optional[RolloutEngine] = None,
                 standalone: bool = True):
        self.config, self.channel, self.standalone = config, channel, standalone
        self.engine = engine or RolloutEngine.from_config(config)
        self.started = False
        self.stop = asyncio.Event()
        self.tasks: set[asyncio.Task] = set()
        self.generations: dict[int, asyncio.Task] = {}  # by request id: what a CancelRequest may stop
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
        if isinstance(request, CancelRequest):
            generation = self.generations.get(request.id)
            if generation is not None:
                generation.cancel()  # the engine aborts its sequences; no reply: the caller left
            return
        task = asyncio.ensure_future(self.handle(request, blob))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if isinstance(request, (GenerateRequest, GroupRequest)):
            rid = request.id
            self.generations[rid] = task
            task.add_done_callback(lambda _: self.generations.pop(rid, None))

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
            warm: Optional[WeightUpdate] = None
            if request.weights_stream is not None:
                warm = self._spooled(request.weights_stream)
            elif blob is not None:
                warm = InlineWeights(blob)
            try:
                await e.start(weights=warm, version=request.version)
            finally:
                if isinstance(warm, FileWeights):
                    self.spool.release(warm.file)
            self.started = True
            return ReadyReply(id=request.id, pid=os.getpid(), core_pids=e.core_pids(), worker_count=e.worker_count,
                              stats=self.stats(), file_view=file_view() if self.TAKES_LOCAL_FILES else "")
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
            weights = self._received(request, blob)
            try:
                t = await e.update_weights(weights, request.version)
            finally:
                if isinstance(weights, FileWeights) and isinstance(request.weights, WeightsByStream):
                    # the spool's copy, not the trainer's file
                    self.spool.release(weights.file)
            return UpdatedReply(id=request.id, version=t.version, sync_ms=t.sync_ms, load_ms=t.load_ms,
                                stats=self.stats())
        value: Any
        if isinstance(request, HandOffRequest):
            value = await e.hand_off(request.count)
        elif isinstance(request, JoinGroupRequest):
            value = await e.join_weight_group(request.info)
        elif isinstance(request, ChecksumRequest):
            value = await e.weights_checksum()
        elif isinstance(request, SleepRequest):
            value = await e.sleep()
        elif isinstance(request, WakeRequest):
            value = await e.wake_up(None if request.tags is None else list(request.tags))
        else:
            raise TypeError(f"unexpected request {request.kind!r}")
        return ValueReply(id=request.id, value=value, stats=self.stats())

    def _spooled(self, stream: int) -> FileWeights:
        """The file a stream of chunks left in the spool, as the update it is."""
        file = self.spool.take(stream)
        try:
            return FileWeights.of(file)
        except BaseException:
            self.spool.release(file)  # not a safetensors file: nothing will load it
            raise

    def _received(self, request: UpdateRequest, blob: Optional[bytes]) -> WeightUpdate:
        """The update an ``UpdateRequest`` carries, as the engine takes it (weights/update.py)."""
        wire_weights = request.weights
        if isinstance(wire_weights, WeightsByBroadcast):
            return BroadcastWeights(_RemoteWeights(wire_weights.meta, lambda: self._arrive(request.id)))
        if isinstance(wire_weights, WeightsByStream):
            return self._spooled(wire_weights.stream)
        if isinstance(wire_weights, WeightsByPath):  # the trainer's own file: it stays the trainer's to remove
            if not self.TAKES_LOCAL_FILES:
                raise ValueError("this engine takes weights by the wire only (a path could name another run's file)")
            return FileWeights.of(local_weight_file(wire_weights.path, self.spool.max_bytes))
        if blob is not None:
            return InlineWeights(blob)
        raise ValueError("an update whose weights were to be attached came without them")

    async def _arrive(self, update_id: int) -> None:
        from workers.weights.weight_group import WeightBroadcastError

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
