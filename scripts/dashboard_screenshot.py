"""The README's dashboard screenshot (docs/assets/dashboard.png), made from a real run.

Stands up a real web server (tests/browser/liveserver.py: daphne, its own data folder and
SQLite database), makes a demo account, submits examples/add-async.yaml cut to a short run
through the REST API, and trains it with the real engine (`python -m workers run`, vLLM and
DeepSpeed), which reports to that server with a run token as the Celery dispatcher's engine
would. Then Debian's Chromium, driven by Playwright, signs in and photographs the run page.

    .venv/bin/python scripts/dashboard_screenshot.py [--steps 120] [--out docs/assets/dashboard.png]

A few minutes on 2 cores (the engine's start-up, then the steps)."""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import requests
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "browser"), str(REPO)]
from liveserver import LiveServer, launch_profile  # noqa: E402

log = logging.getLogger("dashboard_screenshot")
PASSWORD = "screenshot-pass"


def api(base: str, key: str) -> requests.Session:
    session = requests.Session()
    session.trust_env = False  # loopback: never through a proxy
    session.headers["Authorization"] = f"Bearer {key}"
    return session


def short_spec(steps: int) -> dict:
    spec = yaml.safe_load((REPO / "examples" / "add-async.yaml").read_text())
    spec["stop"] = {"max_steps": steps, "max_minutes": 10}
    spec["eval"] = {"every_steps": max(steps // 6, 1), "prompts": 200}
    return spec


def train(server: LiveServer, key: str, steps: int, workdir: Path) -> int:
    """Submit the run, then train it with the real engine reporting to the server."""
    http = api(server.url, key)
    reply = http.post(f"{server.url}/api/runs/", json={"spec": short_spec(steps), "tags": ["demo"]}, timeout=60)
    reply.raise_for_status()
    run_id = reply.json()["id"]
    token = http.post(f"{server.url}/api/runs/{run_id}/tokens/", timeout=60).json()["key"]
    # What the Celery dispatcher reports before it starts the engine, which then reports `running`.
    api(server.url, token).post(f"{server.url}/api/runs/{run_id}/status/", timeout=60, json={
        "status": "starting", "worker_host": "screenshot", "worker_pid": os.getpid()}).raise_for_status()
    spec_path = workdir / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(short_spec(steps)))
    env = {**os.environ, "FLUXRL_RUN_TOKEN": token}
    log.info("training run %d for %d steps with the real engine", run_id, steps)
    subprocess.run([sys.executable, "-m", "workers", "run", str(spec_path), "--out", str(workdir / "out"),
                    "--platform", server.url, "--run-id", str(run_id), "--no-progress"],
                   cwd=REPO, env=env, check=True, timeout=1800)
    return run_id


def photograph(server: LiveServer, run_id: int, out: Path, profile: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = launch_profile(playwright, profile, viewport={"width": 1440, "height": 1000},
                                 base_url=server.url, device_scale_factor=1)
        page = context.new_page()
        page.goto("/login/")
        page.get_by_label("Username").fill("demo")
        page.get_by_label("Password").fill(PASSWORD)
        page.get_by_role("button", name="Sign in").click()
        page.wait_for_url("**/")
        page.goto(f"/runs/{run_id}/")
        page.wait_for_selector(".js-plotly-plot", timeout=60_000)
        page.wait_for_load_state("networkidle")
        page.wait_for_timeout(2000)  # the charts' last extension and relayout
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out), full_page=False)
        context.close()
    log.info("wrote %s", out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120, help="training steps of the photographed run")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "assets" / "dashboard.png")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.pop("DATABASE_URL", None)  # the server's own SQLite file, nothing left on a shared PostgreSQL
    with tempfile.TemporaryDirectory(prefix="fluxrl-screenshot-") as tmp:
        workdir = Path(tmp)
        with LiveServer(workdir / "server") as server:
            key = server.manage("bootstrap_demo", "--password", PASSWORD).strip()
            run_id = train(server, key, args.steps, workdir)
            photograph(server, run_id, args.out.resolve(), workdir / "profile")


if __name__ == "__main__":
    main()
