"""Live-view latency: from the moment a worker starts its POST of a metrics batch to
the moment a websocket client subscribed to the run (ws/runs/<id>/) receives that batch,
through a real daphne on a fresh database (PostgreSQL with DATABASE_URL, else SQLite).
Both ends are in this process, so one clock times them.

    .venv/bin/python bench/ws_latency.py [--batches 300] [--rate 20] [--points 10] [--redis redis://127.0.0.1:6379/15]

--redis: the channel layer of production (several web processes); default in-memory."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time

import requests
from websockets.asyncio.client import connect

from run_server import run_server

KEYS = ["reward/mean", "reward/std", "loss/policy", "throughput/samples_per_s", "staleness/mean",
        "weights/sync_ms", "lengths/mean", "policy/entropy", "queue/depth", "version/current"]


def post_batches(url: str, key: str, batches: int, rate: float, points: int, sent: dict[int, float],
                 posts: list[float]) -> None:
    """One batch per step, `rate` a second, like an engine's reporter."""
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {key}"
    start = time.perf_counter()
    for step in range(batches):
        time.sleep(max(0.0, start + step / rate - time.perf_counter()))
        body = {"points": [{"key": KEYS[i % len(KEYS)], "step": step, "value": i / points, "time": time.time()}
                           for i in range(points)]}
        sent[step] = time.perf_counter()
        response = session.post(url, json=body, timeout=30)
        posts.append(time.perf_counter() - sent[step])
        response.raise_for_status()


async def measure(server_url: str, run_id: int, user_key: str, run_key: str, args) -> tuple[list[float], list[float]]:
    sent, posts, latencies = {}, [], {}
    ws_url = server_url.replace("http", "ws", 1) + f"/ws/runs/{run_id}/"
    async with connect(ws_url, origin=server_url, additional_headers={"Authorization": f"Bearer {user_key}"}) as ws:
        for _ in range(3):  # status, history, recent samples
            await ws.recv()
        poster = threading.Thread(target=post_batches, args=(f"{server_url}/api/runs/{run_id}/metrics/", run_key,
                                                             args.batches, args.rate, args.points, sent, posts))
        poster.start()
        deadline = time.monotonic() + args.batches / args.rate + 60
        while len(latencies) < args.batches and time.monotonic() < deadline:
            message = json.loads(await asyncio.wait_for(ws.recv(), timeout=30))
            received = time.perf_counter()
            if message["type"] == "metrics":
                step = message["points"][0]["step"]
                latencies.setdefault(step, received - sent[step])
        poster.join()
    return list(latencies.values()), posts


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--rate", type=float, default=20.0, help="batches per second")
    parser.add_argument("--points", type=int, default=10, help="points per batch (one step of every metric)")
    parser.add_argument("--redis", help="a Redis URL for the channel layer (default: in-memory)")
    args = parser.parse_args()

    with run_server(args.redis) as (server, run_id, run_key, user_key):
        warm = requests.Session()  # first requests: connections, imports, caches
        for step in range(10):
            warm.post(f"{server.url}/api/runs/{run_id}/metrics/", timeout=30, headers={"Authorization": f"Bearer {run_key}"},
                      json={"points": [{"key": "bench/warm-up", "step": step, "value": 0}]}).raise_for_status()
        latencies, posts = asyncio.run(measure(server.url, run_id, user_key, run_key, args))
        database = "PostgreSQL" if server.database else "SQLite"

    if len(latencies) < args.batches:
        raise SystemExit(f"only {len(latencies)} of {args.batches} batches arrived")
    ms = lambda values, q: quantile(values, q) * 1000  # noqa: E731
    layer = "Redis" if args.redis else "in-memory"
    print(f"{database}, daphne, {layer} channel layer, {args.batches} batches of {args.points} points at {args.rate:g}/s: "
          f"POST -> websocket p50 {ms(latencies, 0.5):.1f} ms, p95 {ms(latencies, 0.95):.1f} ms, "
          f"max {max(latencies) * 1000:.1f} ms (the POST alone: p50 {ms(posts, 0.5):.1f} ms, p95 {ms(posts, 0.95):.1f} ms; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
