"""A worker process of this node's coordinator, and the micro-batches it is fed.

The inference stage's models (a reward model, the KL reference) each run in a process of
their own, started by the coordinator as ``python -m <module> <fd> <config>``. The two
ends talk over a private socketpair: there is no address, so nothing else can connect.
Messages are length-prefixed JSON frames with a size cap; every call has a deadline; a
worker that dies, stalls or fails to load is a ``LocalWorkerError`` that says which.
The worker reads end of stream when the coordinator closes its end or dies, and exits
(while it loads or answers, its parent watch ends it: workers/io/lifetime.py).

``token_chunks`` splits a micro-batch into forwards of at most ``inference.micro_batch_tokens``
padded tokens, so that a GPU worker's forward stays within what the memory planner counts.

``MicroBatcher`` gathers the items of callers that arrive close together (samples that
finish generating in the same moments) into batches of at most ``size``, waiting at most
``max_wait_s`` for a partial one, and runs one call per batch in a thread.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

from workers.io.lifetime import exit_with_parent, launcher_env

logger = logging.getLogger(__name__)

MAX_FRAME = 64 << 20  # a micro-batch and its answer: far below this
_HEADER = struct.Struct(">I")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class LocalWorkerError(RuntimeError):
    """The worker cannot answer: it failed to load, died, missed its deadline or failed a call."""


def send_frame(sock: socket.socket, message: dict) -> None:
    body = json.dumps(message).encode()
    if len(body) > MAX_FRAME:
        raise LocalWorkerError(f"a message of {len(body)} bytes exceeds the {MAX_FRAME}-byte cap")
    sock.sendall(_HEADER.pack(len(body)) + body)


def recv_frame(sock: socket.socket) -> Optional[dict]:
    """The next message, or None at end of stream."""
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME:
        raise LocalWorkerError(f"a frame announces {size} bytes, over the {MAX_FRAME}-byte cap")
    body = _recv_exact(sock, size)
    if body is None:
        raise LocalWorkerError("the stream ended inside a frame")
    return json.loads(body)


def _recv_exact(sock: socket.socket, size: int) -> Optional[bytes]:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            if left == size:
                return None
            raise LocalWorkerError("the stream ended inside a frame")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def serve(fd: int, load: Callable[[], tuple[Callable[[dict], dict], dict]]) -> int:
    """The worker's side: ``load()`` returns (handler, hello); the hello is announced, then
    each request is answered with ``handler(request)`` until the coordinator closes its end.
    A failed load or call is answered ``{"error": ...}`` (the worker lives on after a call)."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    exit_with_parent(code=1)  # the stream's end comes only between calls, not while loading or answering
    sock = socket.socket(fileno=fd)
    try:
        handler, hello = load()
    except Exception as exc:  # noqa: BLE001 - reported to the coordinator, which names it
        send_frame(sock, {"error": f"{type(exc).__name__}: {exc}"})
        return 1
    send_frame(sock, {"ready": True, "pid": os.getpid(), **hello})
    while True:
        request = recv_frame(sock)
        if request is None:
            return 0
        try:
            reply = handler(request)
        except Exception as exc:  # noqa: BLE001 - a failed call fails that batch only
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        send_frame(sock, reply)


def stage_env(placement) -> dict[str, str]:
    """The environment that puts an inference-stage worker on its GPU: ``placement`` is its
    process in a GPU plan (workers/cluster/placement.py, role "inference"), None on a CPU plan."""
    if placement is None or placement.cuda_visible_devices is None:
        return {}
    return {"CUDA_VISIBLE_DEVICES": placement.cuda_visible_devices}


class LocalWorker:
    """The coordinator's end: starts ``python -m module <fd> <config JSON>`` and calls it."""

    def __init__(self, name: str, module: str, config: dict, threads: int = 1, timeout_s: float = 120.0,
                 start_timeout_s: float = 300.0, env: Optional[dict[str, str]] = None):
        self.name = name  # for messages: "the reward model", "the KL reference"
        self.module, self.config, self.threads = module, config, threads
        self.env = dict(env or {})  # on top of this process's: where the plan puts it (CUDA_VISIBLE_DEVICES)
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.hello: dict = {}
        self._sock: Optional[socket.socket] = None
        self._lock = threading.Lock()  # one call in flight: the worker answers in order

    def start(self) -> dict:
        parent, child = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, str(child.fileno()), json.dumps(self.config)],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True, cwd=_ROOT,
                env={**os.environ, "OMP_NUM_THREADS": str(self.threads), **self.env, **launcher_env()})
        finally:
            child.close()
        self._sock = parent
        parent.settimeout(self.start_timeout_s)
        try:
            hello = recv_frame(parent)
        except (OSError, LocalWorkerError) as exc:
            self.close()
            raise LocalWorkerError(f"{self.name} did not start in {self.start_timeout_s:.0f} s ({exc})") from None
        if hello is None or "error" in hello:
            code = self.proc.wait(timeout=30)
            self.close()
            why = hello["error"] if hello else f"its process exited with code {code}"
            raise LocalWorkerError(f"{self.name} cannot be loaded: {why}")
        self.hello = hello
        return hello

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def call(self, request: dict) -> dict:
        """One request and its answer, within ``timeout_s`` (blocking: call it in a thread)."""
        with self._lock:
            if self._sock is None:
                raise LocalWorkerError(f"{self.name} is closed")
            self._sock.settimeout(self.timeout_s)
            why = None
            try:
                send_frame(self._sock, request)
                reply = recv_frame(self._sock)
            except socket.timeout:
                raise LocalWorkerError(f"{self.name} did not answer within its deadline of "
                                       f"{self.timeout_s:g} s") from None
            except OSError as exc:
                reply, why = None, str(exc)
            if reply is None:
                code = self.proc.poll() if self.proc else None
                raise LocalWorkerError(f"{self.name}'s worker died" + (f" (exit code {code})" if code is not None
                                                                         else "") + (f": {why}" if why else ""))
            if "error" in reply:
                raise LocalWorkerError(f"{self.name} failed: {reply['error']}")
            return reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()  # the worker reads end of stream and exits
            self._sock = None
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def token_chunks(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of sequences of ``lengths`` tokens in consecutive chunks whose padded forward
    (count x the longest) holds at most ``max_tokens`` tokens; a longer sequence goes alone.
    An inference stage splits a micro-batch this way so that its full-vocabulary logits stay
    bounded."""
    chunks: list[list[int]] = []
    width = 0
    for i, length in enumerate(lengths):
        if chunks and (len(chunks[-1]) + 1) * max(width, length) <= max_tokens:
            chunks[-1].append(i)
            width = max(width, length)
        else:
            chunks.append([i])
            width = length
    return chunks


def forward_in_chunks(items: Sequence, lengths: Sequence[int], max_tokens: int,
                      forward: Callable[[list], list]) -> list:
    """``forward`` over ``items`` in the chunks :func:`token_chunks` makes of them, the results
    back in the items' order."""
    out: list = [None] * len(items)
    for chunk in token_chunks(lengths, max_tokens):
        for i, result in zip(chunk, forward([items[i] for i in chunk])):
            out[i] = result
    return out


class MicroBatcher:
    """``await submit(item)`` -> its result, from ``run(items) -> results`` called (in a
    thread) on batches of at most ``size`` items, a partial one after ``max_wait_s``. A
    failed batch fails it and every later submit with the same error."""

    def __init__(self, run: Callable[[list], list], size: int, max_wait_s: float):
        self.run, self.size, self.max_wait_s = run, size, max_wait_s
        self.batches = 0  # calls made
        self.items = 0  # items answered
        self.busy_s = 0.0  # time spent in calls
        self._queue: list[tuple[Any, asyncio.Future]] = []
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._failed: Optional[BaseException] = None

    async def submit(self, item) -> Any:
        if self._failed is not None:
            raise self._failed
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()  # (a batcher of a closed loop never runs again)
            self._task = loop.create_task(self._loop())
        future = loop.create_future()
        self._queue.append((item, future))
        self._wake.set()
        return await future

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            deadline = time.monotonic() + self.max_wait_s
            while len(self._queue) < self.size and time.monotonic() < deadline:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), deadline - time.monotonic())
                except asyncio.TimeoutError:
                    break
            self._wake.clear()
            while self._queue:
                batch, self._queue = self._queue[:self.size], self._queue[self.size:]
                started = time.monotonic()
                try:
                    results = await asyncio.to_thread(self.run, [item for item, _ in batch])
                except Exception as exc:  # noqa: BLE001 - handed to every waiting caller
                    self._failed = exc
                    for _, future in batch + self._queue:
                        if not future.done():
                            future.set_exception(exc)
                    self._queue = []
                    return
                self.batches += 1
                self.items += len(batch)
                self.busy_s += time.monotonic() - started
                for (_, future), result in zip(batch, results):
                    if not future.done():
                        future.set_result(result)

    def stats(self) -> dict[str, float]:
        return {"batches": self.batches, "items": self.items, "busy_s": self.busy_s,
                "mean_batch": self.items / self.batches if self.batches else 0.0}

    def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()


class StageClient:
    """The coordinator's end of a no-grad stage in a worker process of its own (the KL
    reference, the critic's values): the worker, started with ``config`` on the plan's
    ``placement`` (None on a CPU plan), and a MicroBatcher that sends it ``_forward``'s
    micro-batches. A subclass names the stage (``name``), its worker module and what
    stats() calls a batched item (``unit``)."""

    name = "a stage"
    module = ""
    unit = "samples"

    def __init__(self, spec, config: dict, placement=None):
        inf = spec.inference
        self.worker = LocalWorker(self.name, self.module, config, threads=inf.threads, timeout_s=inf.timeout_s,
                                  env=stage_env(placement))
        self.batcher = MicroBatcher(self._forward, inf.micro_batch, inf.max_wait_ms / 1000)

    def _forward(self, items: list) -> list:
        raise NotImplementedError

    def start(self) -> None:
        hello = self.worker.start()
        logger.info("%s: worker pid %d", self.name, hello["pid"])

    @property
    def proc(self):
        return self.worker.proc

    def stats(self) -> dict[str, float]:
        stats = self.batcher.stats()
        stats[self.unit] = stats.pop("items")
        return stats

    def close(self) -> None:
        self.batcher.close()
        self.worker.close()
