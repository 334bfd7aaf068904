"""Where a run's numbers go: a JSONL file always, and the platform's REST API when a
URL and a run-scoped token are given (batched, retried, never blocking training).

Metric names are the API (docs/architecture.md §5). Points are keyed by (key, step) and the
platform stores them idempotently, so a retried batch never duplicates a point.
"""
from __future__ import annotations

import itertools
import json
import logging
import random
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional

import requests

# Engine diagnostics: workers/cli/engine.py sends them to stderr, which the platform keeps
# as the run's engine.log (shown on the dashboard).
log = logging.getLogger(__name__)


class PlatformClient:
    """The worker's side of the seam: run-scoped bearer token, JSON over HTTP."""

    def __init__(self, base_url: str, token: str, run_id: int | str, timeout: float = 10.0):
        self.base = base_url.rstrip("/")
        self.run_id = run_id
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"
        self.timeout = timeout

    def post(self, what: str, payload: dict) -> dict:
        r = self.session.post(f"{self.base}/api/runs/{self.run_id}/{what}/", json=payload, timeout=self.timeout)
        if r.status_code >= 400:
            raise requests.HTTPError(f"{r.status_code} from {what}: {r.text[:300]}", response=r)
        return r.json() if r.content else {}

    def status(self, status: str, reason: str = "", **extra) -> dict:
        return self.post("status", {"status": status, "failure_reason": reason, **extra})


class Reporter:
    """Collects metric points and samples; a background thread ships them in batches.

    When the platform is unreachable (or answers 5xx/429) everything stays buffered and
    is retried with exponential backoff; the platform skips points it already stored, so
    a batch whose answer was lost is simply sent again. The buffer is bounded: past
    max_points / max_samples the oldest entries are dropped, with a logged warning
    (the points stay in metrics.jsonl)."""

    MAX_BATCH = 1000  # the ingest endpoint's limit
    SAMPLE_BATCH = 50
    # The ingest endpoint takes 1 MiB a request (FLUXRL_INGEST_MAX_BYTES): long samples,
    # with their per-token texts, go in smaller batches (one sample at least).
    SAMPLE_BATCH_BYTES = 512 * 1024
    # A sample's per-token texts: the platform's limits (FLUXRL_SAMPLE_MAX_TOKENS, default).
    MAX_SAMPLE_TOKENS = 16384
    MAX_TOKEN_CHARS = 200

    def __init__(self, jsonl_path: Optional[str | Path] = None, platform: Optional[PlatformClient] = None,
                 flush_every_s: float = 0.5, echo=None, max_points: int = 200_000, max_samples: int = 5_000,
                 max_backoff_s: float = 10.0, close_timeout_s: float = 30.0):
        self.path = Path(jsonl_path) if jsonl_path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        self.platform = platform
        self.flush_every_s = flush_every_s
        self.max_points, self.max_samples = max_points, max_samples
        self.max_backoff_s, self.close_timeout_s = max_backoff_s, close_timeout_s
        self.latest: dict[str, float] = {}
        self.echo = echo
        self.exporters = None  # workers/io/exporters.Exporters: the run's report.* exporters, fed every point
        self._points: deque[dict] = deque()
        self._samples: deque[dict] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.failures = 0  # failed posts, all told
        self.dropped_points = self.dropped_samples = 0  # lost to a full buffer
        self._warned_tokens = False
        self._failing_since: Optional[float] = None
        self._streak = 0  # consecutive failed posts
        self._thread = threading.Thread(target=self._loop, name="fluxrl-reporter", daemon=True)
        if platform is not None:
            self._thread.start()

    def log(self, step: int, values: dict[str, Any], when: Optional[float] = None) -> None:
        when = time.time() if when is None else when
        points = [{"key": k, "step": int(step), "value": float(v), "time": when}
                  for k, v in values.items() if v is not None]
        with self._lock:
            self.latest.update({p["key"]: p["value"] for p in points})
            if self.path:
                for p in points:
                    self._file.write(json.dumps(p) + "\n")
                self._file.flush()
            if self.platform is not None:
                self._points.extend(points)
                overflow = len(self._points) - self.max_points
                if overflow > 0:
                    self._drop(self._points, overflow, "points")
        if self.exporters is not None:  # queued for their own thread: never blocks or raises
            self.exporters.put(points)

    def resend(self, points: list[dict]) -> None:
        """Queue points already written to metrics.jsonl for the platform again, ahead of
        new ones (a resumed run: the platform may lack some of them, and skips those it
        has). Nothing is written to the file."""
        if self.platform is None or not points:
            return
        with self._lock:
            self._points.extendleft(reversed(points))
            overflow = len(self._points) - self.max_points
            if overflow > 0:
                self._drop(self._points, overflow, "points")

    def sample(self, record: dict) -> None:
        if self.platform is not None:
            record = self._checked_tokens(record)
            with self._lock:
                self._samples.append(record)
                if len(self._samples) > self.max_samples:
                    self._drop(self._samples, len(self._samples) - self.max_samples, "samples")

    def _checked_tokens(self, record: dict) -> dict:
        """A sample whose per-token texts the platform would refuse (not one per version,
        or past its limits) goes without them: a 400 would lose its whole batch."""
        tokens = record.get("tokens")
        if tokens is None:
            return record
        versions = record.get("versions") or []
        problem = ("not one per token of versions" if len(tokens) != len(versions) else
                   f"more than {self.MAX_SAMPLE_TOKENS}" if len(tokens) > self.MAX_SAMPLE_TOKENS else
                   f"a token over {self.MAX_TOKEN_CHARS} characters"
                   if any(not isinstance(t, str) or len(t) > self.MAX_TOKEN_CHARS for t in tokens) else None)
        if problem is None:
            return record
        if not self._warned_tokens:
            self._warned_tokens = True
            log.warning("a sample's tokens (%s) are left out of its report; the platform shows its "
                        "completion without token boundaries", problem)
        return {k: v for k, v in record.items() if k != "tokens"}

    def _drop(self, buffer: deque, count: int, what: str) -> None:
        """Drop the oldest `count` entries of a full buffer (lock held): losing old
        points beats growing without bound while the platform is away."""
        for _ in range(count):
            buffer.popleft()
        before = self.dropped_points + self.dropped_samples
        if what == "points":
            self.dropped_points += count
        else:
            self.dropped_samples += count
        if before == 0 or (before + count) // 10_000 > before // 10_000:  # first drop, then every 10,000
            log.warning("the platform has been unreachable and the report buffer is full "
                        "(%d points, %d samples): dropped the oldest (%d points, %d samples so far); "
                        "metrics.jsonl keeps every point", self.max_points, self.max_samples,
                        self.dropped_points, self.dropped_samples)

    @property
    def pending(self) -> tuple[int, int]:
        """(points, samples) not yet accepted by the platform."""
        with self._lock:
            return len(self._points), len(self._samples)

    def _loop(self) -> None:
        delay = self.flush_every_s
        while not self._stop.wait(delay):
            delay = self.flush_every_s if self._ship() else self._backoff()
        deadline = time.monotonic() + self.close_timeout_s
        while not self._ship() and time.monotonic() < deadline:
            time.sleep(min(self._backoff(), max(0.0, deadline - time.monotonic())))
        points, samples = self.pending
        if points or samples:
            log.warning("the platform stayed unreachable for %.0f s at the end: %d points and %d samples "
                        "were not sent (metrics.jsonl has the points)", self.close_timeout_s, points, samples)

    def _backoff(self) -> float:
        """Seconds to wait after a failure: doubling from flush_every_s up to max_backoff_s,
        with jitter so that many engines do not come back in step."""
        streak = min(self._streak, 16)
        return min(self.max_backoff_s, self.flush_every_s * 2 ** streak) * random.uniform(0.5, 1.0)

    def _ship(self) -> bool:
        """Send everything buffered, batch after batch. False if the platform could not
        be reached (what is left stays buffered)."""
        while True:
            with self._lock:
                points = list(itertools.islice(self._points, self.MAX_BATCH))
                samples = self._sample_batch()
            if not points and not samples:
                return True
            try:
                if points:
                    self._post_or_drop("metrics", {"points": points})
                    self._sent(self._points, points)
                if samples:
                    self._post_or_drop("samples", {"samples": samples})
                    self._sent(self._samples, samples)
            except requests.RequestException as exc:
                self.failures += 1
                self._streak += 1
                if self._failing_since is None:
                    self._failing_since = time.monotonic()
                    log.warning("cannot reach the platform (%s); buffering and retrying", exc)
                return False
            if self._failing_since is not None:
                log.info("the platform is reachable again after %.1f s; sending what was buffered",
                         time.monotonic() - self._failing_since)
                self._failing_since = None
            self._streak = 0

    def _sample_batch(self) -> list[dict]:
        """The oldest buffered samples (lock held): up to SAMPLE_BATCH of them, within
        SAMPLE_BATCH_BYTES of JSON unless the first alone is larger."""
        batch, size = [], 0
        for sample in itertools.islice(self._samples, self.SAMPLE_BATCH):
            size += len(json.dumps(sample)) + 2
            if batch and size > self.SAMPLE_BATCH_BYTES:
                break
            batch.append(sample)
        return batch

    def _sent(self, buffer: deque, batch: list) -> None:
        """Forget a batch the platform accepted. The buffer may have lost its oldest
        entries to an overflow meanwhile: remove only what is still the same objects."""
        with self._lock:
            for item in batch:
                if buffer and buffer[0] is item:
                    buffer.popleft()

    def _post_or_drop(self, what: str, payload: dict) -> None:
        """A 4xx answer will not change on retry: log it and drop the batch rather than
        resend it forever (5xx, 429 and network errors are retried)."""
        try:
            self.platform.post(what, payload)
        except requests.HTTPError as exc:
            status = exc.response.status_code if exc.response is not None else 500
            if status >= 500 or status == 429:
                raise
            log.warning("platform refused a %s batch: %s", what, exc)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.close_timeout_s + 30)
        if self.path:
            self._file.close()
