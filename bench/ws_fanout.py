"""Live-view fan-out under load: --clients websocket clients subscribed to one run
(ws/runs/<id>/?token=...) while metric ingest runs at full speed into that run through
the REST API (POST /api/runs/<id>/metrics/, run token), on a real daphne with
PostgreSQL (DATABASE_URL) and the Redis channel layer (--redis), as in production.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/fluxrl nice -n 10 .venv/bin/python bench/ws_fanout.py \\
        --redis redis://127.0.0.1:6379/13 [--clients 200] [--posters 2] [--posts 300] [--steps-per-post 10] [--keys 10]

Each poster thread owns its own --keys metrics and posts batches of --steps-per-post
steps back to back (each waits only for the previous answer). Every batch is one
"append" for the live views. Each client must receive every append, once, in each
poster's order. Reported: appends sent vs received per client (missing, duplicated,
out of order), delivery latency (POST start -> a client's receipt, over all clients),
and the server's RSS (psutil) idle, with clients connected, at peak and at the end.
Clients run in --client-procs processes, so that parsing 200 streams is not the
bottleneck of this process. JSON goes to bench/results/ws_fanout.json."""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import threading
import time
from pathlib import Path

import psutil
import requests

from run_server import run_server

RESULTS = Path(__file__).resolve().parent / "results"


# --- clients (in child processes) -------------------------------------------------------


async def follow(ws_url: str, origin: str, connected: "multiprocessing.Queue", stop: "multiprocessing.Event") -> dict:
    """One client: connect, then record every live metrics message as (poster, first step,
    receipt time) until told to stop. Returns what it saw."""
    from websockets.asyncio.client import connect

    seen, history, closed = [], 0, None
    async with connect(ws_url, origin=origin, max_size=None, open_timeout=120) as ws:
        while True:
            try:
                raw = await asyncio.wait_for(ws.recv(), timeout=0.5)
            except asyncio.TimeoutError:
                if stop.is_set():
                    break
                continue
            except Exception as exc:  # noqa: BLE001 - a closed socket is a result, not a crash
                closed = f"{type(exc).__name__}: {exc}"
                break
            received = time.time()
            message = json.loads(raw)
            if message["type"] == "samples" and message.get("history"):
                connected.put(1)  # the last message of the snapshot: subscribed
            if message["type"] != "metrics" or not message["points"]:
                continue
            if message.get("history"):
                history += 1
                continue
            # A batch is one poster's (bench/p<i>.m<k>) steps: name it by poster and first step.
            poster = message["points"][0]["key"].split("/")[1].split(".")[0]
            seen.append((poster, min(p["step"] for p in message["points"]), received))
    return {"seen": seen, "history": history, "closed": closed}


def client_process(ws_url: str, origin: str, count: int, connected, stop, results) -> None:
    async def main():
        tasks = []
        for _ in range(count):  # connect a few at a time: 200 handshakes at once time out on a busy machine
            tasks.append(asyncio.create_task(follow(ws_url, origin, connected, stop)))
            await asyncio.sleep(0.02)
        return await asyncio.gather(*tasks, return_exceptions=True)

    out = asyncio.run(main())
    results.put([o if isinstance(o, dict) else {"seen": [], "history": 0, "closed": repr(o)} for o in out])


# --- ingest and memory (this process) ------------------------------------------------------


def poster(url: str, key: str, poster_id: int, args, sent: dict, errors: list) -> None:
    """Batches of steps-per-post steps of this poster's keys, back to back."""
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {key}"
    keys = [f"bench/p{poster_id}.m{k}" for k in range(args.keys)]
    for post in range(args.posts):
        first = post * args.steps_per_post
        body = {"points": [{"key": k, "step": s, "value": (s % 97) / 97, "time": time.time()}
                           for s in range(first, first + args.steps_per_post) for k in keys]}
        sent[(f"p{poster_id}", first)] = time.time()
        response = session.post(url, json=body, timeout=120)
        if response.status_code != 201:
            errors.append(f"{response.status_code} {response.text[:200]}")


class RssSampler(threading.Thread):
    def __init__(self, pid: int, every: float = 0.1):
        super().__init__(daemon=True)
        self.process, self.every, self.peak, self.running, self.died = psutil.Process(pid), every, 0, True, False

    def rss(self) -> int:
        try:
            return self.process.memory_info().rss
        except psutil.NoSuchProcess:
            self.died = True
            return 0

    def run(self):
        while self.running and not self.died:
            self.peak = max(self.peak, self.rss())
            time.sleep(self.every)


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def check_client(client: dict, expected: dict[str, list[int]], sent: dict) -> dict:
    """Compare what a client saw with what was posted: per poster, every first step once, in order."""
    by_poster: dict[str, list[int]] = {p: [] for p in expected}
    latencies = []
    for poster_key, step, received in client["seen"]:
        by_poster.setdefault(poster_key, []).append(step)
        latencies.append(received - sent[(poster_key, step)])
    missing = sum(len(set(steps) - set(by_poster[p])) for p, steps in expected.items())
    duplicated = sum(len(steps) - len(set(steps)) for steps in by_poster.values())
    out_of_order = sum(sum(1 for a, b in zip(steps, steps[1:]) if b <= a) for steps in by_poster.values())
    return {"received": len(client["seen"]), "missing": missing, "duplicated": duplicated,
            "out_of_order": out_of_order, "closed": client["closed"], "latencies": latencies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--client-procs", type=int, default=4, help="processes the clients are spread over")
    parser.add_argument("--posters", type=int, default=2, help="concurrent ingest threads, each with its own keys")
    parser.add_argument("--posts", type=int, default=300, help="batches per poster")
    parser.add_argument("--steps-per-post", type=int, default=10)
    parser.add_argument("--keys", type=int, default=10, help="metrics per poster (points per batch = keys x steps)")
    parser.add_argument("--redis", help="Redis URL of the channel layer (default: in-memory)")
    parser.add_argument("--drain-timeout", type=float, default=120, help="seconds to wait for the last appends")
    parser.add_argument("--out", default=str(RESULTS / "ws_fanout.json"))
    parser.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for the server (e.g. to compare channel layer options)")
    args = parser.parse_args()
    extra_env = dict(item.split("=", 1) for item in args.server_env)

    with run_server(args.redis, **extra_env) as (server, run_id, run_key, user_key):
        warm = requests.Session()  # connections, imports, first queries
        for step in range(5):
            warm.post(f"{server.url}/api/runs/{run_id}/metrics/", timeout=30, headers={"Authorization": f"Bearer {run_key}"},
                      json={"points": [{"key": "bench/warm-up", "step": step, "value": 0}]}).raise_for_status()
        if args.redis:  # members left in the group by an earlier run's (killed) server: not ours to feed
            import redis

            redis.Redis.from_url(args.redis).delete(f"asgi:group:run-{run_id}")
        rss = RssSampler(server.process.pid)
        rss_idle = rss.rss()
        rss.start()

        ctx = multiprocessing.get_context("spawn")
        connected, results, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
        ws_url = server.url.replace("http", "ws", 1) + f"/ws/runs/{run_id}/?token={user_key}"
        per_proc = [args.clients // args.client_procs + (i < args.clients % args.client_procs) for i in range(args.client_procs)]
        procs = [ctx.Process(target=client_process, args=(ws_url, server.url, n, connected, stop, results)) for n in per_proc if n]
        for proc in procs:
            proc.start()
        start = time.monotonic()
        for i in range(args.clients):
            connected.get(timeout=max(5.0, 180 - (time.monotonic() - start)))
        connect_s = time.monotonic() - start
        rss_connected = rss.rss()

        sent, errors = {}, []
        url = f"{server.url}/api/runs/{run_id}/metrics/"
        threads = [threading.Thread(target=poster, args=(url, run_key, p, args, sent, errors)) for p in range(args.posters)]
        ingest_start = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        ingest_s = time.monotonic() - ingest_start
        rss_after_ingest = rss.rss()

        # Wait for the last append of every poster to reach every client (or the timeout).
        drain_start = time.monotonic()
        last_sent = max(sent.values())
        time.sleep(1.0)
        # Children stop on our signal; before that, give delivery time to finish: poll the server's
        # CPU and stop once it has been idle (under 5%) for 2 s, or at the drain timeout.
        server_proc, idle_since = psutil.Process(server.process.pid), None
        server_proc.cpu_percent(None)
        while time.monotonic() - drain_start < args.drain_timeout:
            time.sleep(0.5)
            if server_proc.cpu_percent(None) < 5:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since >= 2:
                    break
            else:
                idle_since = None
        drain_s = time.monotonic() - drain_start
        rss_end = rss.rss()
        stop.set()
        clients = [c for _ in procs for c in results.get(timeout=120)]
        for proc in procs:
            proc.join(30)
        time.sleep(1.0)
        rss_closed = rss.rss()
        rss.running = False
        database = "PostgreSQL" if server.database else "SQLite"
        # The server's log goes with its temporary folder: keep what is not an access line.
        server_log = [line for line in server.log_path.read_text(errors="replace").splitlines()
                      if not line.startswith("127.0.0.1:")]
        log_tail = "\n".join(server_log[-40:])

    if rss.died:
        print(log_tail)
        raise SystemExit("the server process died during the run")
    if errors:
        print(log_tail)
        raise SystemExit(f"{len(errors)} ingest requests failed, e.g. {errors[0]}")
    expected = {f"p{p}": [i * args.steps_per_post for i in range(args.posts)] for p in range(args.posters)}
    checks = [check_client(c, expected, sent) for c in clients]
    appends = args.posters * args.posts
    latencies = [x for c in checks for x in c["latencies"]]
    mib = lambda b: round(b / 2**20, 1)  # noqa: E731
    summary = {
        "setup": {"database": database, "channel_layer": "Redis" if args.redis else "in-memory", "server": "1 daphne",
                  "clients": args.clients, "client_procs": args.client_procs, "posters": args.posters,
                  "posts_per_poster": args.posts, "points_per_post": args.keys * args.steps_per_post,
                  "server_env": extra_env, "cpus": os.cpu_count(), "load_average": round(os.getloadavg()[0], 1)},
        "ingest": {"appends": appends, "points": appends * args.keys * args.steps_per_post, "seconds": round(ingest_s, 2),
                   "points_per_s": round(appends * args.keys * args.steps_per_post / ingest_s),
                   "appends_per_s": round(appends / ingest_s, 1)},
        "delivery": {
            "clients_connected": len(clients), "connect_s": round(connect_s, 1),
            "clients_complete": sum(1 for c in checks if c["received"] == appends and not c["missing"]),
            "received_min": min(c["received"] for c in checks), "received_max": max(c["received"] for c in checks),
            "missing_total": sum(c["missing"] for c in checks), "duplicated_total": sum(c["duplicated"] for c in checks),
            "out_of_order_total": sum(c["out_of_order"] for c in checks),
            "clients_closed_early": sum(1 for c in checks if c["closed"]),
            "closed_reasons": sorted({c["closed"] for c in checks if c["closed"]})[:5],
            "messages_delivered": len(latencies), "messages_per_s": round(len(latencies) / (ingest_s + drain_s), 1),
            "latency_ms": {"p50": round(quantile(latencies, 0.5) * 1000, 1), "p95": round(quantile(latencies, 0.95) * 1000, 1),
                           "max": round(max(latencies) * 1000, 1)} if len(latencies) > 1 else None,
            "drain_s": round(drain_s, 1), "last_receipt_after_last_post_s":
                round(max((s[2] for c in clients for s in c["seen"]), default=last_sent) - last_sent, 2),
        },
        "server_rss_mib": {"idle": mib(rss_idle), "clients_connected": mib(rss_connected), "peak": mib(rss.peak),
                           "after_ingest": mib(rss_after_ingest), "end": mib(rss_end), "clients_closed": mib(rss_closed)},
        "per_client": [{k: v for k, v in c.items() if k != "latencies"} for c in checks],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))

    d, r, i = summary["delivery"], summary["server_rss_mib"], summary["ingest"]
    rows = [
        ("setup", f"{database}, {summary['setup']['channel_layer']} channel layer, 1 daphne, {args.clients} websocket clients "
                  f"in {args.client_procs} processes, load average {summary['setup']['load_average']} on {os.cpu_count()} CPUs"),
        ("ingest", f"{args.posters} posters x {args.posts} batches of {args.keys * args.steps_per_post} points: "
                   f"{i['points']:,} points in {i['seconds']} s = {i['points_per_s']:,} points/s ({i['appends_per_s']} appends/s)"),
        ("appends sent", f"{appends} to each client ({appends * len(clients):,} in all)"),
        ("appends received", f"min {d['received_min']}, max {d['received_max']} per client; "
                             f"{d['clients_complete']}/{len(clients)} clients got every append"),
        ("dropped / dup / out of order", f"{d['missing_total']} / {d['duplicated_total']} / {d['out_of_order_total']}"),
        ("closed early", f"{d['clients_closed_early']} {d['closed_reasons'] or ''}"),
        ("delivery latency", f"p50 {d['latency_ms']['p50']} ms, p95 {d['latency_ms']['p95']} ms, max {d['latency_ms']['max']} ms"
                             if d["latency_ms"] else "-"),
        ("delivered", f"{d['messages_delivered']:,} messages, {d['messages_per_s']:,}/s; last one {d['last_receipt_after_last_post_s']} s "
                      "after the last POST"),
        ("server RSS (MiB)", f"idle {r['idle']}, {args.clients} connected {r['clients_connected']}, peak {r['peak']}, "
                             f"end {r['end']}, clients gone {r['clients_closed']}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    print(f"(JSON: {args.out})")
    if d["missing_total"] or d["duplicated_total"] or d["out_of_order_total"] or d["clients_closed_early"]:
        print(f"--- server log, last lines other than requests:\n{log_tail}")
        raise SystemExit("appends were dropped, duplicated or reordered")


if __name__ == "__main__":
    main()
