"""The engine's heartbeat keeps its cadence when the platform answers slowly: beats start
every ``every_s`` from the last one's start, so a slow reply (the platform reconnecting to
its database after an outage) does not add its own duration to the gap the reaper judges."""
from __future__ import annotations

import json
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from workers.io.heartbeat import Heartbeat
from workers.io.report import PlatformClient


class SlowStatusServer:
    """An HTTP server on loopback that answers each status report after ``delay_s``,
    recording when each request arrived."""

    def __init__(self, delay_s: float):
        self.arrivals: list[float] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                outer.arrivals.append(time.monotonic())
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                time.sleep(delay_s)
                body = json.dumps({"status": "running", "cancel_requested": False}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def beat_against(delay_s: float, every_s: float, for_s: float) -> tuple[list, list, Heartbeat]:
    """Beat every ``every_s`` against a server that replies after ``delay_s``, for ``for_s``:
    the beats' arrival times, the gaps between them, and the heartbeat."""
    server = SlowStatusServer(delay_s=delay_s)
    heartbeat = Heartbeat(PlatformClient(server.url, "key", 1, timeout=5), every_s=every_s).start()
    try:
        time.sleep(for_s)
    finally:
        heartbeat.stop()
        server.close()
    return server.arrivals, [b - a for a, b in zip(server.arrivals, server.arrivals[1:])], heartbeat


def test_a_slow_reply_does_not_widen_the_gap_between_beats():
    arrivals, gaps, heartbeat = beat_against(delay_s=0.4, every_s=0.5, for_s=3.4)
    assert len(arrivals) >= 5 and heartbeat.beats >= 4
    # every_s apart, not every_s + the 0.4 s reply (0.9 s); the median forgives one late thread
    assert statistics.median(gaps) < 0.65, gaps


def test_a_reply_slower_than_the_cadence_is_followed_by_the_next_beat_at_once():
    _, gaps, _ = beat_against(delay_s=0.8, every_s=0.3, for_s=4.0)
    # the reply's 0.8 s, no 0.3 s wait on top (1.1 s)
    assert len(gaps) >= 2 and statistics.median(gaps) < 0.95, gaps
