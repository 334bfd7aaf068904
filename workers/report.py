"""Where a run's numbers go: a JSONL file always, and the platform's REST API when a
URL and a run-scoped token are given (batched, retried, never blocking training).

Metric names are the API (DESIGN.md §5). Points are keyed by (key, step) and the
platform stores them idempotently, so a retried batch never duplicates a point.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import requests


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
    """Collects metric points and samples; a background thread ships them in batches."""

    MAX_BATCH = 1000  # the ingest endpoint's limit

    def __init__(self, jsonl_path: Optional[str | Path] = None, platform: Optional[PlatformClient] = None,
                 flush_every_s: float = 0.5, echo=None):
        self.path = Path(jsonl_path) if jsonl_path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        self.platform = platform
        self.flush_every_s = flush_every_s
        self.latest: dict[str, float] = {}
        self.echo = echo
        self._points: list[dict] = []
        self._samples: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.failures = 0
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

    def sample(self, record: dict) -> None:
        if self.platform is not None:
            with self._lock:
                self._samples.append(record)

    def _loop(self) -> None:
        while not self._stop.wait(self.flush_every_s):
            self._ship()
        self._ship(final=True)

    def _ship(self, final: bool = False) -> None:
        deadline = time.time() + (30 if final else 0)
        while True:
            with self._lock:
                points, samples = self._points[: self.MAX_BATCH], self._samples[:50]
            if not points and not samples:
                return
            try:
                if points:
                    self._post_or_drop("metrics", {"points": points})
                if samples:
                    self._post_or_drop("samples", {"samples": samples})
            except requests.RequestException:
                # Platform unreachable: keep everything buffered and try again later.
                self.failures += 1
                if not final or time.time() > deadline:
                    return
                time.sleep(1.0)
                continue
            with self._lock:
                del self._points[: len(points)]
                del self._samples[: len(samples)]

    def _post_or_drop(self, what: str, payload: dict) -> None:
        """A 4xx answer will not change on retry: log it and drop the batch rather than
        resend it forever (5xx and network errors are retried)."""
        try:
            self.platform.post(what, payload)
        except requests.HTTPError as exc:
            status = exc.response.status_code if exc.response is not None else 500
            if status >= 500 or status == 429:
                raise
            print(f"platform refused a {what} batch: {exc}", file=sys.stderr)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
        if self.path:
            self._file.close()
