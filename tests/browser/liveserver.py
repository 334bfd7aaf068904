"""A real FluxRL web server for the browser tests and bench/dashboard_load.py: daphne
serving fluxrl.asgi (HTTP and websockets, as in production) on a free port, with its own
data folder and database: a SQLite file, or a fresh PostgreSQL database on the server
DATABASE_URL names (dropped afterwards). pytest-django's live_server is WSGI (no
websockets) and its SQLite test database lives in memory, out of a server process' reach.

Also: launch_profile(), Debian's Chromium driven by Playwright (never `playwright install`)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit
from urllib.request import urlopen

from workers.io import ports

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


def launch_profile(playwright, profile_dir, **options):
    """Chromium with a profile on disk (a persistent context), like a person's browser."""
    return playwright.chromium.launch_persistent_context(
        str(profile_dir), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS, **options)


def free_port() -> int:
    """Outside the ephemeral range: the server binds it later (workers/io/ports.py)."""
    return ports.free_port("127.0.0.1")


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


def postgres(url: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(with_database(url, "postgres"), autocommit=True) as connection:
        connection.execute(sql)


class LiveServer:
    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.data_dir = self.workdir / "data"
        self.import_root = self.workdir / "imports"  # FLUXRL_DATASET_IMPORT_ROOT: datasets folders to import
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = None
        self.database = None
        self.log_path = self.workdir / "daphne.log"
        self.env = self._environment()

    def _environment(self) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DJANGO_SETTINGS_MODULE")}
        # No REDIS_URL: the in-memory channel layer (one server process) and a Celery broker
        # inside the data folder, so no Celery worker elsewhere on the machine takes these runs.
        env.update(FLUXRL_DATA_DIR=str(self.data_dir), PYTHONPATH=f"{REPO / 'platform'}{os.pathsep}{REPO}",
                   DJANGO_SETTINGS_MODULE="fluxrl.settings", FLUXRL_WS_STATUS_POLL_S="1", PYTHONUNBUFFERED="1")
        env["FLUXRL_DATASET_IMPORT_ROOT"] = str(self.import_root)
        if os.environ.get("DATABASE_URL", "").startswith("postgres"):
            self.database = f"fluxrl_browser_{uuid.uuid4().hex[:10]}"
            env["DATABASE_URL"] = with_database(os.environ["DATABASE_URL"], self.database)
        else:
            env.pop("DATABASE_URL", None)  # the embedded default: a SQLite file in the data folder
        return env

    def manage(self, *args: str) -> str:
        result = subprocess.run([sys.executable, str(REPO / "manage.py"), *args], env=self.env, cwd=REPO,
                                capture_output=True, text=True, timeout=300)
        if result.returncode:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{result.stderr[-3000:]}")
        return result.stdout

    def start(self) -> LiveServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.database:
            postgres(os.environ["DATABASE_URL"], f'CREATE DATABASE "{self.database}"')
        self.manage("migrate", "-v0")
        log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), "fluxrl.asgi:application"],
            env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"daphne exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                with urlopen(f"{self.url}/login/", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"daphne did not answer within 60 s:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.database:
            postgres(os.environ["DATABASE_URL"], f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
            self.database = None

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
