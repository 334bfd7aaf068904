"""How the run page copes with a long run: one run with --points points for each of 10
metrics, served by a real daphne (tests/browser/liveserver.py) on SQLite, or on a fresh
PostgreSQL database when DATABASE_URL is set; Chromium (Debian's, headless) opens the
run page and we read, from the browser's own timings:

- time to first chart: navigation start -> the reward chart drawn with data
  (performance mark "fluxrl:first-chart" set by static/js/run.js), and to all charts,
  on a first visit and on returning visits (Plotly cached and its code compiled);
- page data: the HTML and the metric history the page fetched (server-side downsampled
  to 1000 points per series), and Plotly's own size;
- the metrics read service alone (fluxrl.metrics.services.read_series), in this process.

    .venv/bin/python bench/dashboard_load.py [--points 100000] [--repeat 3]

Points are written straight into the database (COPY / executemany): sending 1M points
through the ingest API would measure ingest, not the page. This machine is shared and
noisy: the medians of --repeat page loads are printed."""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "browser"))
from liveserver import LiveServer, launch_profile  # noqa: E402

KEYS = ["reward/mean", "reward/std", "eval/accuracy", "throughput/samples_per_s", "throughput/tokens_per_s",
        "staleness/mean", "staleness/max", "weights/sync_ms", "loss/policy", "lengths/mean"]
PASSWORD = "bench-pass"


def django_against(server: LiveServer):
    """Set Django up in this process on the server's database and data folder."""
    os.environ.clear()
    os.environ.update(server.env)  # its database, data folder, and no REDIS_URL
    sys.path[:0] = [str(REPO / "platform"), str(REPO)]
    import django

    django.setup()


def insert_points(run_id: int, points: int) -> float:
    from django.db import connection, transaction

    from fluxrl.metrics.models import MetricPoint

    table = MetricPoint._meta.db_table
    rng = random.Random(0)
    start = time.perf_counter()

    def rows(key):
        value = 0.0
        for step in range(points):
            value += rng.gauss(0, 0.01)
            yield run_id, key, step, value + step / points, 1763769600.0 + step * 0.5

    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            with cursor.connection.cursor().copy(f"COPY {table} (run_id, key, step, value, time) FROM STDIN") as copy:
                for key in KEYS:
                    for row in rows(key):
                        copy.write_row(row)
            cursor.execute(f"ANALYZE {table}")
        else:
            for key in KEYS:
                cursor.executemany(f"INSERT INTO {table} (run_id, key, step, value, time) VALUES (%s, %s, %s, %s, %s)",
                                   list(rows(key)))
    return time.perf_counter() - start


def time_read_service(run_id: int) -> dict:
    from fluxrl.metrics.services import read_series
    from fluxrl.runs.models import Run

    run = Run.objects.get(pk=run_id)
    out = {}
    for label, keys in (("2 series (the reward chart)", ["reward/mean", "reward/std"]), ("all 10 series", None)):
        start = time.perf_counter()
        series = read_series(run, keys, max_points=1000)
        out[label] = (time.perf_counter() - start, sum(len(s["step"]) for s in series.values()))
    return out


PAGE_FIGURES = """() => {
    const nav = performance.getEntriesByType("navigation")[0];
    const mark = (name) => (performance.getEntriesByName(name)[0] || {}).startTime ?? null;
    const resources = performance.getEntriesByType("resource");
    const sum = (test, field) => resources.filter((r) => test(r.name)).reduce((n, r) => n + r[field], 0);
    const metrics = (name) => name.includes("/metrics/");
    return {
        first_chart_ms: mark("fluxrl:first-chart"), all_charts_ms: mark("fluxrl:all-charts"),
        script_ms: mark("fluxrl:script"),
        html_bytes: nav.decodedBodySize, html_ms: nav.responseEnd,
        metrics_bytes: sum(metrics, "decodedBodySize"), metrics_requests: resources.filter((r) => metrics(r.name)).length,
        metrics_server_ms: resources.filter((r) => metrics(r.name)).map((r) => r.responseStart - r.requestStart),
        first_data_ms: (resources.find((r) => r.initiatorType === "link" && metrics(r.name)) || {}).responseEnd ?? null,
        plotly_bytes: sum((n) => n.includes("plotly"), "decodedBodySize"),
        plotly_transferred: sum((n) => n.includes("plotly"), "transferSize"),
        points_drawn: [...document.querySelectorAll(".js-plotly-plot")].reduce(
            (n, el) => n + (el.data || []).reduce((m, t) => m + (t.x ? t.x.length : 0), 0), 0),
    };
}"""


def load_page(context, url: str) -> dict:
    page = context.new_page()
    page.goto(url)
    page.wait_for_function("performance.getEntriesByName('fluxrl:all-charts').length > 0", timeout=120_000)
    figures = page.evaluate(PAGE_FIGURES)
    page.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=int, default=100_000, help="points per metric")
    parser.add_argument("--repeat", type=int, default=3, help="page loads to take the median of")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as workdir, LiveServer(Path(workdir)) as server:
        database = "PostgreSQL" if server.database else "SQLite"
        key = server.manage("bootstrap_demo", "--username", "bench", "--password", PASSWORD, "--team", "bench").strip()
        spec = {"name": "long-run", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"}}
        reply = requests.post(f"{server.url}/api/runs/", json={"spec": spec}, headers={"Authorization": f"Bearer {key}"},
                              timeout=30)
        reply.raise_for_status()
        run_id = reply.json()["id"]
        django_against(server)
        insert_seconds = insert_points(run_id, args.points)
        print(f"{database}: {len(KEYS)} metrics x {args.points:,} points = {len(KEYS) * args.points:,} rows "
              f"inserted in {insert_seconds:.1f} s")
        for label, (seconds, kept) in time_read_service(run_id).items():
            print(f"read_series, {label}, max_points=1000: {seconds * 1000:.0f} ms ({kept:,} points kept)")

        from playwright.sync_api import sync_playwright

        with sync_playwright() as playwright, tempfile.TemporaryDirectory() as profile:
            # A persistent profile, as a person's browser: Chromium keeps compiled JavaScript
            # (V8's code cache) from the second visit on; a throwaway context never does.
            context = launch_profile(playwright, profile, viewport={"width": 1366, "height": 768}, base_url=server.url)
            page = context.new_page()
            page.goto("/login/")
            page.get_by_label("Username").fill("bench")
            page.get_by_label("Password").fill(PASSWORD)
            page.get_by_role("button", name="Sign in").click()
            page.wait_for_url("**/")
            page.close()
            url = f"/runs/{run_id}/"
            cold = load_page(context, url)  # first visit: Plotly downloaded and compiled
            load_page(context, url)  # second visit: Chromium stores the compiled code
            warm = [load_page(context, url) for _ in range(args.repeat)]
            context.close()

    med = lambda key: statistics.median(f[key] for f in warm)  # noqa: E731
    server_ms = [ms for f in warm for ms in f["metrics_server_ms"]]
    print(f"run page, first visit: first chart {cold['first_chart_ms']:.0f} ms, all charts {cold['all_charts_ms']:.0f} ms; "
          f"Plotly {cold['plotly_bytes'] / 1e6:.2f} MB ({cold['plotly_transferred'] / 1e6:.2f} MB transferred), "
          f"page script starts at {cold['script_ms']:.0f} ms (after Plotly is parsed)")
    print(f"run page, returning visit (median of {args.repeat}): first chart {med('first_chart_ms'):.0f} ms, "
          f"all charts {med('all_charts_ms'):.0f} ms, HTML {med('html_ms'):.0f} ms, script starts {med('script_ms'):.0f} ms, "
          f"first chart's data (preloaded) in {med('first_data_ms'):.0f} ms")
    print(f"page data: HTML {med('html_bytes') / 1e3:.1f} kB + metric history {med('metrics_bytes') / 1e3:.0f} kB "
          f"in {warm[0]['metrics_requests']} requests ({warm[0]['points_drawn']:,} points drawn, "
          f"of {len(KEYS) * args.points:,} stored)")
    print(f"metrics API response time (requests wait their turn on the server): median {statistics.median(server_ms):.0f} ms, "
          f"max {max(server_ms):.0f} ms")


if __name__ == "__main__":
    main()
