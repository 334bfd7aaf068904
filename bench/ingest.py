"""Ingest throughput: metric points stored per second through the REST API
(POST /api/runs/<id>/metrics/ with a run token, in batches of --batch points, the
engine's Reporter batch), served by a real daphne on a fresh PostgreSQL database
(DATABASE_URL) or SQLite. --clients threads post concurrently, bodies encoded beforehand,
so the figure is the server's: parse, validate, insert, push to the run's live group.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/fluxrl .venv/bin/python bench/ingest.py \\
        [--points 200000] [--batch 1000] [--clients 4] [--servers 1] [--redis redis://127.0.0.1:6379/15] \\
        [--insert copy|unnest|orm] [--no-pool] [--compare --rounds 3]

--compare measures the path before COPY and the pool (--insert unnest --no-pool) and the
chosen one in alternating rounds, each on a fresh server and database, and prints the
ratio of their medians. Points are counted in the database afterwards: what is reported
is what was stored. On PostgreSQL the server's connections are sampled during the run:
they must stay within the pool (FLUXRL_DB_POOL_MAX, 10) and none may be left checked out."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import requests

from run_server import more_servers, run_server

KEYS = ["reward/mean", "reward/std", "loss/policy", "throughput/samples_per_s", "staleness/mean",
        "weights/sync_ms", "lengths/mean", "policy/entropy", "queue/depth", "version/current"]
POOL_MAX = 10  # the server's FLUXRL_DB_POOL_MAX


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


def server_connections() -> int:
    """Clients of this database other than this process (autovacuum workers not counted)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND backend_type = 'client backend' AND pid <> pg_backend_pid()")
        return cursor.fetchone()[0]


def measure(args) -> dict:
    """One configuration on a fresh server: {points/s, latencies, connections, ...}."""
    work = bodies(args.points, args.batch)
    env = {"FLUXRL_INGEST_INSERT": args.insert, "FLUXRL_DB_POOL": "0" if args.no_pool else "1",
           "FLUXRL_DB_POOL_MAX": str(POOL_MAX)}
    if args.batch > 1000:
        env |= {"FLUXRL_INGEST_MAX_POINTS": str(args.batch), "FLUXRL_INGEST_MAX_BYTES": str(len(max(work, key=len)))}
    with run_server(args.redis, **env) as (server, run_id, run_key, _), more_servers(server, args.servers - 1) as others:
        from fluxrl.metrics.models import MetricPoint

        postgres = server.database is not None
        urls = [f"{base}/api/runs/{run_id}/metrics/" for base in [server.url, *others]]
        for url in urls:
            post_all(url, run_key, work[:3], [], [])  # warm up: connections, imports, first queries
        MetricPoint.objects.filter(run_id=run_id).delete()
        latencies, errors, connections, done = [], [], [], threading.Event()

        def sample_connections():
            from django.db import connection

            while not done.wait(0.2):
                connections.append(server_connections())
            connection.close()  # this thread's own, which would count as the server's

        sampler = threading.Thread(target=sample_connections) if postgres else None
        threads = [threading.Thread(target=post_all, args=(urls[i % len(urls)], run_key, work[i::args.clients], latencies, errors))
                   for i in range(args.clients)]
        start = time.perf_counter()
        for thread in [*threads, *([sampler] if sampler else [])]:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - start
        done.set()
        if sampler:
            sampler.join()
            time.sleep(0.5)  # the last requests hand their connections back
        stored = MetricPoint.objects.filter(run_id=run_id).count()
        after = server_connections() if postgres else None
        if errors:  # the servers' logs go with their temporary folder: show them now
            for log in sorted(server.workdir.glob("daphne*.log")):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}")
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
    if stored != args.points:
        raise SystemExit(f"expected {args.points:,} points stored, found {stored:,}")
    return {"database": "PostgreSQL" if postgres else "SQLite", "stored": stored, "seconds": seconds,
            "points_per_s": stored / seconds, "requests": len(work), "median_ms": statistics.median(latencies) * 1000,
            "p95_ms": statistics.quantiles(latencies, n=20)[-1] * 1000, "max_connections": max(connections, default=None),
            "connections_after": after}


def describe(args) -> str:
    return f"--insert {args.insert}{' --no-pool' if args.no_pool else ''}"


def report(args, result: dict) -> str:
    layer = "Redis" if args.redis else "in-memory"
    line = (f"{result['database']}, daphne ({args.servers} process{'es' if args.servers > 1 else ''}), {layer} channel layer, "
            f"{describe(args)}: {result['stored']:,} points stored in {result['seconds']:.2f} s = {result['points_per_s']:,.0f} points/s "
            f"({result['requests']} requests of {args.batch}, {args.clients} clients; request median {result['median_ms']:.0f} ms, "
            f"p95 {result['p95_ms']:.0f} ms")
    if result["max_connections"] is not None:
        line += f"; server connections: at most {result['max_connections']} during, {result['connections_after']} after"
    return line + f"; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)"


def check_connections(args, result: dict) -> None:
    """The pool bounds the server's connections; without it each request closes its own."""
    if result["max_connections"] is None:
        return
    limit = POOL_MAX * args.servers if not args.no_pool else args.clients * 2
    if result["max_connections"] > limit or result["connections_after"] > (0 if args.no_pool else limit):
        raise SystemExit(f"connections leaked: {result['max_connections']} during the run, "
                         f"{result['connections_after']} after (limit {limit})")


def compare(args, argv: list[str]) -> None:
    """Rounds of (before, chosen), each in a process of its own (Django is set up once per
    process, on one server's database), interleaved so that the machine's load is shared."""
    before = [a for a in argv if a not in ("--compare", "--no-pool")]
    before = [*before[:before.index("--insert")], *before[before.index("--insert") + 2:]] if "--insert" in before else before
    configurations = {"before": [*before, "--insert", "unnest", "--no-pool"], "chosen": [a for a in argv if a != "--compare"]}
    results = {name: [] for name in configurations}
    for _ in range(args.rounds):
        for name, child_argv in configurations.items():
            output = subprocess.run([sys.executable, __file__, *child_argv, "--json"], capture_output=True, text=True)
            if output.returncode:
                raise SystemExit(f"{name} failed:\n{output.stdout[-3000:]}\n{output.stderr[-3000:]}")
            line, result = output.stdout.strip().splitlines()[-2:]
            print(line, flush=True)
            results[name].append(json.loads(result)["points_per_s"])
    old, new = (statistics.median(results[name]) for name in ("before", "chosen"))
    print(f"median of {args.rounds} rounds: before (--insert unnest --no-pool) {old:,.0f} points/s, "
          f"{describe(args)} {new:,.0f} points/s = {new / old:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=1000,
                        help="points per request (above 1000, the default limit, the server's limit is raised)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent posting threads")
    parser.add_argument("--servers", type=int, default=1, help="daphne processes, clients spread over them")
    parser.add_argument("--redis", help="a Redis URL for the channel layer (default: in-memory; several servers want Redis)")
    parser.add_argument("--insert", choices=["copy", "unnest", "orm"], default="copy",
                        help="how the server writes to PostgreSQL (FLUXRL_INGEST_INSERT)")
    parser.add_argument("--no-pool", action="store_true", help="a database connection per request (FLUXRL_DB_POOL=0)")
    parser.add_argument("--compare", action="store_true", help="also measure the path before COPY and the pool; print the ratio")
    parser.add_argument("--rounds", type=int, default=3, help="with --compare: rounds of both")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compare:
        compare(args, sys.argv[1:])
        return
    result = measure(args)
    print(report(args, result))
    if args.json:
        print(json.dumps(result))
    check_connections(args, result)


if __name__ == "__main__":
    main()
