"""Ingest throughput: metric points stored per second through the REST API
(POST /api/runs/<id>/metrics/ with a run token, in batches of --batch points, the
engine's Reporter batch), served by a real daphne on a fresh PostgreSQL database
(DATABASE_URL) or SQLite. --clients threads post concurrently, bodies encoded beforehand,
so the figure is the server's: parse, validate, insert, push to the run's live group.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/fluxrl .venv/bin/python bench/ingest.py \\
        [--points 200000] [--batch 1000] [--clients 4] [--servers 1] [--redis redis://127.0.0.1:6379/15]

Points are counted in the database afterwards: what is reported is what was stored."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import requests

from run_server import more_servers, run_server

KEYS = ["reward/mean", "reward/std", "loss/policy", "throughput/samples_per_s", "staleness/mean",
        "weights/sync_ms", "lengths/mean", "policy/entropy", "queue/depth", "version/current"]


def bodies(points: int, batch: int) -> list[bytes]:
    """Batches as the engine sends them: every key at each step, steps rising."""
    rows = ({"key": KEYS[i % len(KEYS)], "step": i // len(KEYS), "value": (i % 97) / 97, "time": 1763769600.0 + i / 1000}
            for i in range(points))
    out, chunk = [], []
    for row in rows:
        chunk.append(row)
        if len(chunk) == batch:
            out.append(json.dumps({"points": chunk}).encode())
            chunk = []
    if chunk:
        out.append(json.dumps({"points": chunk}).encode())
    return out


def post_all(url: str, key: str, work: list[bytes], latencies: list[float], errors: list[str]) -> None:
    session = requests.Session()
    session.headers.update({"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    for body in work:
        start = time.perf_counter()
        response = session.post(url, data=body, timeout=60)
        latencies.append(time.perf_counter() - start)
        if response.status_code != 201:
            errors.append(f"{response.status_code} {response.text[:200]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=1000,
                        help="points per request (above 1000, the default limit, the server's limit is raised)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent posting threads")
    parser.add_argument("--servers", type=int, default=1, help="daphne processes, clients spread over them")
    parser.add_argument("--redis", help="a Redis URL for the channel layer (default: in-memory; several servers want Redis)")
    args = parser.parse_args()

    work = bodies(args.points, args.batch)
    limits = {"FLUXRL_INGEST_MAX_POINTS": str(args.batch), "FLUXRL_INGEST_MAX_BYTES": str(len(max(work, key=len)))}
    with run_server(args.redis, **(limits if args.batch > 1000 else {})) as (server, run_id, run_key, _), \
            more_servers(server, args.servers - 1) as others:
        from fluxrl.metrics.models import MetricPoint

        urls = [f"{base}/api/runs/{run_id}/metrics/" for base in [server.url, *others]]
        for url in urls:
            post_all(url, run_key, work[:3], [], [])  # warm up: connections, imports, first queries
        MetricPoint.objects.filter(run_id=run_id).delete()
        latencies, errors = [], []
        threads = [threading.Thread(target=post_all, args=(urls[i % len(urls)], run_key, work[i::args.clients], latencies, errors))
                   for i in range(args.clients)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - start
        stored = MetricPoint.objects.filter(run_id=run_id).count()
        database = "PostgreSQL" if server.database else "SQLite"
        if errors:  # the servers' logs go with their temporary folder: show them now
            for log in sorted(server.workdir.glob("daphne*.log")):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}")

    if errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
    layer = "Redis" if args.redis else "in-memory"
    print(f"{database}, daphne ({args.servers} process{'es' if args.servers > 1 else ''}), {layer} channel layer: {stored:,} points stored in {seconds:.2f} s "
          f"= {stored / seconds:,.0f} points/s ({len(work)} requests of {args.batch}, {args.clients} clients; "
          f"request median {statistics.median(latencies) * 1000:.0f} ms, "
          f"p95 {statistics.quantiles(latencies, n=20)[-1] * 1000:.0f} ms; load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs)")
    if stored != args.points:
        raise SystemExit(f"expected {args.points:,} points stored, found {stored:,}")


if __name__ == "__main__":
    main()
