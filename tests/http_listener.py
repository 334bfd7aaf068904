"""A real HTTP listener on 127.0.0.1 that records every request it gets and answers each
with one canned reply: the address a crafted URI would send a worker to, or a tracker
whose error reply carries text that must not reach a run's log."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterator, Union

Reply = Union[bytes, Callable[[dict], bytes]]  # the body, or one made from the request's headers


@contextmanager
def listener(status: int = 404, body: Reply = b"not found", content_type: str = "text/plain"
             ) -> Iterator[tuple[int, list[dict]]]:
    """(port, requests): each request as {method, path, headers}, in the order they came."""
    requests: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            headers = dict(self.headers)
            requests.append({"method": self.command, "path": self.path, "headers": headers})
            data = body(headers) if callable(body) else body
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = answer

        def log_message(self, *args) -> None:  # quiet: the test reads `requests`
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="http-listener", daemon=True)
    thread.start()
    try:
        yield server.server_address[1], requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
