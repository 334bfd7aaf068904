"""A neural reward model as a scoring stage (``reward.model``).

The model, a Hugging Face ``*ForSequenceClassification`` folder with one label, runs in a
worker process of its own (``python -m workers.rewards.model``), never in the
coordinator's: its forwards do not hold the coordinator's GIL, and a crash of the model
is a named error, not a dead run loop. The two ends talk over a private socketpair (no
address anywhere: nothing else can connect), in length-prefixed JSON frames with a size
cap, and every call has a deadline.

``RewardModelClient.score(text)`` is awaited by each finishing sample; the client gathers
the texts of samples that finish close together into micro-batches (at most
``micro_batch`` texts, waiting at most ``max_wait_ms`` for a partial one) and sends one
forward per micro-batch. This is the inference stage that runs while the rest of the
rollout still generates. The worker pads each micro-batch to its longest text and keeps
the last ``max_length`` tokens of each (the completion's end is what is scored).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

MAX_FRAME = 64 << 20  # a micro-batch of texts, or its scores: far below this
_HEADER = struct.Struct(">I")


class RewardModelError(RuntimeError):
    """The reward model cannot score: it failed to load, died, or missed its deadline."""


def send_frame(sock: socket.socket, message: dict) -> None:
    body = json.dumps(message).encode()
    if len(body) > MAX_FRAME:
        raise RewardModelError(f"a reward-model message of {len(body)} bytes exceeds the {MAX_FRAME}-byte cap")
    sock.sendall(_HEADER.pack(len(body)) + body)


def recv_frame(sock: socket.socket) -> Optional[dict]:
    """The next message, or None at end of stream."""
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME:
        raise RewardModelError(f"a reward-model frame announces {size} bytes, over the {MAX_FRAME}-byte cap")
    body = _recv_exact(sock, size)
    if body is None:
        raise RewardModelError("the reward model's stream ended inside a frame")
    return json.loads(body)


def _recv_exact(sock: socket.socket, size: int) -> Optional[bytes]:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            if left == size:
                return None
            raise RewardModelError("the reward model's stream ended inside a frame")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# -- the worker process -------------------------------------------------------------------

class Scorer:
    """The model and its tokenizer, as the worker runs them (also usable in-process by
    the builder and the tests: the same tokenization, the same forward)."""

    def __init__(self, path: str, threads: int = 1):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        torch.set_num_threads(threads)
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, use_safetensors=True).eval()
        if self.model.config.num_labels != 1:
            raise RewardModelError(f"reward.model.path {path!r} has {self.model.config.num_labels} labels; a reward "
                                   "model has one (its logit is the reward)")
        pad = self.tokenizer.pad_token_id
        if pad is None:  # e.g. GPT-2: pad with EOS; the model finds each text's last real token by the mask
            pad = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        self.pad_id = pad
        self.model.config.pad_token_id = pad
        self.max_length = int(getattr(self.model.config, "max_position_embeddings", 0) or 1024)

    def ids(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        return ids[-self.max_length:]

    def logits(self, texts: list[str]) -> list[float]:
        torch = self.torch
        seqs = [self.ids(t) or [self.pad_id] for t in texts]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        with torch.no_grad():  # HF reads each row at its last token that is not the pad id
            return [float(x) for x in self.model(input_ids=ids, attention_mask=mask).logits[:, 0]]


def serve(fd: int, path: str, threads: int) -> int:
    """The worker's loop: load, announce, then answer {"texts": [...]} with {"logits": [...]}
    until the coordinator closes its end."""
    sock = socket.socket(fileno=fd)
    try:
        scorer = Scorer(path, threads)
    except Exception as exc:  # noqa: BLE001 - reported to the coordinator, which names it
        send_frame(sock, {"error": f"{type(exc).__name__}: {exc}"})
        return 1
    send_frame(sock, {"ready": True, "max_length": scorer.max_length, "pid": os.getpid()})
    while True:
        request = recv_frame(sock)
        if request is None:
            return 0
        try:
            send_frame(sock, {"logits": scorer.logits([str(t) for t in request["texts"]])})
        except Exception as exc:  # noqa: BLE001 - a failed forward fails that batch, the worker lives
            send_frame(sock, {"error": f"{type(exc).__name__}: {exc}"})


# -- the coordinator's side ---------------------------------------------------------------

@dataclass
class _Pending:
    text: str
    future: asyncio.Future


class RewardModelClient:
    """Starts the worker, batches texts into its forwards and turns logits into rewards."""

    def __init__(self, spec, start_timeout_s: float = 300.0):
        self.spec = spec  # workers.spec.RewardModelSpec, its path resolved to a folder
        self.start_timeout_s = start_timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self._sock: Optional[socket.socket] = None
        self._io_lock = threading.Lock()  # one forward in flight: the worker answers in order
        self._queue: list[_Pending] = []
        self._wake: Optional[asyncio.Event] = None
        self._batcher: Optional[asyncio.Task] = None
        self.batches = 0  # forwards sent
        self.texts = 0  # texts scored
        self.busy_s = 0.0  # time spent waiting on forwards
        self._failed: Optional[str] = None

    def start(self) -> None:
        parent, child = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "workers.rewards.model", str(child.fileno()), self.spec.path,
                 str(self.spec.threads)],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True,
                cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                env={**os.environ, "OMP_NUM_THREADS": str(self.spec.threads)})
        finally:
            child.close()
        self._sock = parent
        parent.settimeout(self.start_timeout_s)
        try:
            hello = recv_frame(parent)
        except (OSError, RewardModelError) as exc:
            self.close()
            raise RewardModelError(f"the reward model at {self.spec.path} did not start in "
                                   f"{self.start_timeout_s:.0f} s ({exc})") from None
        if hello is None or "error" in hello:
            code = self.proc.wait(timeout=30)
            self.close()
            why = hello["error"] if hello else f"its process exited with code {code}"
            raise RewardModelError(f"reward.model.path {self.spec.path!r} cannot be loaded: {why}")
        logger.info("reward model %s: worker pid %d, up to %d tokens per text", self.spec.path, hello["pid"],
                    hello["max_length"])

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    async def score(self, text: str) -> float:
        """The reward of one text, from the micro-batch it joins. Raises RewardModelError
        when the worker failed (every later call too: the run stops with that error)."""
        if self._failed:
            raise RewardModelError(self._failed)
        loop = asyncio.get_running_loop()
        if self._batcher is None or self._batcher.done() or self._batcher.get_loop() is not loop:
            self._wake = asyncio.Event()  # (a batcher of a closed loop never runs again)
            self._batcher = loop.create_task(self._batch_loop())
        pending = _Pending(text, loop.create_future())
        self._queue.append(pending)
        self._wake.set()
        return await pending.future

    async def _batch_loop(self) -> None:
        size, wait = self.spec.micro_batch, self.spec.max_wait_ms / 1000
        while True:
            await self._wake.wait()
            self._wake.clear()
            deadline = time.monotonic() + wait
            while len(self._queue) < size and time.monotonic() < deadline:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), deadline - time.monotonic())
                except asyncio.TimeoutError:
                    break
            while self._queue:
                batch, self._queue = self._queue[:size], self._queue[size:]
                try:
                    logits = await asyncio.to_thread(self.forward, [p.text for p in batch])
                except RewardModelError as exc:
                    self._failed = str(exc)
                    for p in batch + self._queue:
                        if not p.future.done():
                            p.future.set_exception(RewardModelError(self._failed))
                    self._queue = []
                    return
                for p, logit in zip(batch, logits):
                    if not p.future.done():
                        p.future.set_result(self.reward(logit))

    def reward(self, logit: float) -> float:
        if self.spec.output == "logit":
            return logit
        return 1.0 / (1.0 + math.exp(-logit)) if logit >= 0 else math.exp(logit) / (1.0 + math.exp(logit))

    def forward(self, texts: list[str]) -> list[float]:
        """One micro-batch through the worker (in a thread: the socket blocks)."""
        with self._io_lock:
            if self._sock is None:
                raise RewardModelError("the reward model is closed")
            started = time.monotonic()
            self._sock.settimeout(self.spec.timeout_s)
            try:
                send_frame(self._sock, {"texts": texts})
                reply = recv_frame(self._sock)
            except socket.timeout:
                raise RewardModelError(f"the reward model did not score a micro-batch of {len(texts)} in "
                                       f"reward.model.timeout_s {self.spec.timeout_s:g} s") from None
            except OSError as exc:
                reply, why = None, str(exc)
            else:
                why = None
            if reply is None:
                code = self.proc.poll() if self.proc else None
                raise RewardModelError("the reward model's worker died" + (
                    f" (exit code {code})" if code is not None else "") + (f": {why}" if why else ""))
            if "error" in reply:
                raise RewardModelError(f"the reward model failed on a micro-batch: {reply['error']}")
            logits = reply.get("logits")
            if not isinstance(logits, list) or len(logits) != len(texts):
                raise RewardModelError("the reward model answered a micro-batch with the wrong number of scores")
            self.batches += 1
            self.texts += len(texts)
            self.busy_s += time.monotonic() - started
            return [float(x) for x in logits]

    def close(self) -> None:
        if self._batcher is not None and not self._batcher.done():
            self._batcher.cancel()
        if self._sock is not None:
            self._sock.close()  # the worker reads end of stream and exits
            self._sock = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    fd, path, threads = int(argv[0]), argv[1], int(argv[2])
    return serve(fd, path, threads)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
