"""A reporting engine's heartbeat. The platform fails a live run that has not been heard
of for FLUXRL_RUN_STALE_S (60 s); under Celery the watcher beats for it, but an engine
started by hand (`python -m workers run ... --platform URL --run-id N`) has only itself.
So it re-reports "running" every few seconds from a thread of its own, which keeps going
while a long training step holds the asyncio loop, and hears a cancel in the reply."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import requests

log = logging.getLogger(__name__)  # to stderr, the run's engine.log (workers/cli/engine.py)


class Heartbeat:
    def __init__(self, platform, every_s: float = 15.0, on_cancel: Optional[Callable[[], None]] = None):
        self.platform = platform
        self.every_s = every_s
        self.on_cancel = on_cancel
        self.extra: Optional[Callable[[], dict]] = None  # more to say with each beat (the engine pools a run is on)
        self.beats = 0
        self.cancelled = False  # a reply said cancel_requested
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fluxrl-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _loop(self) -> None:
        failing = False
        due = time.monotonic() + self.every_s
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            # A beat every every_s from the last one's start, not from its reply: a slow
            # reply (the platform busy reconnecting after an outage) must not widen the gap
            # the reaper judges by FLUXRL_RUN_STALE_S.
            due = max(due + self.every_s, time.monotonic())
            try:
                reply = self.platform.status("running", **(self.extra() if self.extra is not None else {}))
            except requests.RequestException as exc:
                status = getattr(getattr(exc, "response", None), "status_code", None)
                if status in (401, 403):  # the run ended: its token stopped working
                    log.warning("heartbeat: the platform no longer takes reports for this run (%s)", exc)
                    return
                if not failing:
                    log.warning("heartbeat: cannot reach the platform (%s); trying again", exc)
                failing = True
                continue
            failing = False
            self.beats += 1
            if reply.get("cancel_requested") and not self.cancelled and self.on_cancel is not None:
                self.cancelled = True
                self.on_cancel()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.platform.timeout + 1)
