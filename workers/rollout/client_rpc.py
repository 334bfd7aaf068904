"""The RPC plumbing of an :class:`~workers.rollout.client.EngineClient`: requests awaited
by their id (with the rollout.rpc_timeout_s deadline where they are timed), the thread that
reads the server's replies, the heartbeat thread, and what a gone server's pending calls
answer. A base of ``EngineClient``, whose ``__init__`` and ``start`` set the state it
reads (the channel, the pending requests and streams, the collective updates' barriers)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from workers.rollout.engine_types import Completion, EngineDied, EngineRPCTimeout
from workers.rollout.messages import (ArrivedEvent, CancelRequest, CompletionReply, EngineStats, ErrorReply,
                                      GenerateRequest, GoRequest, GroupRequest, PingRequest, PongReply, SampleReply,
                                      WireCompletion)
from workers.rollout.staleness import VersionTrack

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0


def _from_wire(w: WireCompletion) -> Completion:
    track = VersionTrack()
    for version, n in w.versions:
        track.add(version, n)
    return Completion(list(w.prompt_ids), list(w.token_ids), list(w.logprobs), track, w.finish_reason,
                      w.start_version, w.started_at, w.finished_at, w.resubmits, w.engine)


class EngineRPC:
    # -- calls ---------------------------------------------------------------------------------
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
        except asyncio.CancelledError:
            # Our cancel reaches the awaited future too (cancelled, so done): only a reply
            # already in means the server is through with it.
            if isinstance(request, (GenerateRequest, GroupRequest)) and (future.cancelled() or not future.done()):
                self._cancel_remote(request.id)  # the server would otherwise generate on for no one
            raise
        except asyncio.TimeoutError:
            raise EngineRPCTimeout(f"rollout engine {self.index} did not answer {request.kind} within "
                                   f"{self.config.rpc_timeout_s:g} s (rollout.rpc_timeout_s)") from None
        finally:
            self._pending.pop(request.id, None)

    def _cancel_remote(self, request_id: int) -> None:
        if self._gone is not None:
            return
        try:
            self.channel.send(CancelRequest(id=request_id))
        except Exception as exc:  # noqa: BLE001 - best effort: a broken connection stops the server with it
            log.debug("rollout engine %d: could not cancel request %d: %s", self.index, request_id, exc)

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
    from workers.weights.weight_group import WeightBroadcastError

    known = {"EngineDied": EngineDied, "EngineRPCTimeout": EngineRPCTimeout, "WeightBroadcastError": WeightBroadcastError}
    if reply.error_type in known:
        return known[reply.error_type](reply.message)
    return RuntimeError(f"rollout engine {index}: {reply.error_type}: {reply.message}")
