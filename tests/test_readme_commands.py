"""Every command in the fenced shell blocks of the README and of the documentation pages
(docs/*.md) is either run here, against a live server, or named in NOT_RUN with the reason:
a documented command cannot rot unnoticed.

The commands are read from README.md, then docs/*.md, when the tests run (not copied here),
so an edit of either is tested as written. The `curl` and `fluxrl` commands are run with bash,
in README order, against a real daphne (tests/browser/liveserver.py: HTTP and
websockets, its own database and data folder, a Celery broker in that folder that no
worker reads, so a submitted run is queued and never trained). What the commands leave
to the reader is filled in:

  http://127.0.0.1:8000 (or localhost:8000)   the live server's address
  $TOKEN                                      a real API token (bootstrap_demo), in the environment
  12, the README's example run id             a run in the state the command needs: queued for
                                              `watch`/`cancel`, failed with a checkpoint for `resume`,
                                              one with samples for `samples`; taken from earlier
                                              commands' output where one fits, else submitted here
  ~ (the CLI's stored login)                  a fresh HOME

A command that follows a run until it ends (`--watch`, `fluxrl watch`) gets a stand-in
engine: a thread that reports starting -> running -> a sample -> succeeded through the
worker API with a run token, as the dispatcher's engine would.

Each curl succeeds with a 2xx status (the YAML submission with 201 and a queued run),
each fluxrl command exits 0."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# The README, then the documentation site's own pages (the guides are tested by their features).
DOCUMENTS = [README, *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
COMMAND_TIMEOUT_S = 90

sys.path.insert(0, str(REPO / "tests" / "browser"))
from liveserver import LiveServer  # noqa: E402

# Commands of the README's shell blocks that this test deliberately does not run. A
# pattern must match the whole command (comments and line continuations removed).
NOT_RUN = [
    (r"scripts/demo\.sh( .*)?",
     "the demo: installs, starts daphne and a Celery worker and trains examples/add-async.yaml for minutes; "
     "its web side is what this test stands up, its client side the `fluxrl` commands run here"),
    (r"scripts/test\.sh( .*)?", "the whole test suite, this test included"),
    (r"(\w+=\S+ )*(nice -n \d+ )?\.venv/bin/python bench/\S+\.py( .*)?",
     "a benchmark (minutes of load, some on a PostgreSQL server of their own); its figures are reported, not asserted"),
    (r"createdb( .*)?", "creates a database on the developer's PostgreSQL server, for a benchmark"),
    (r"scripts/wheelhouse\.sh (build|install) .*",
     "builds the GPU stack's wheelhouse from PyPI, then installs it on a GPU node; tests/scripts/test_wheelhouse.py "
     "checks, joins and installs parts, and tests/scripts/test_gpu_rehearsal.py builds and installs the stack"),
    (r"PYTHONPATH=\. python3 (scripts/engine_imports\.py|-m workers run .*)",
     "on the GPU node, after its install; tests/scripts/test_engine_imports.py and the rehearsal run the import check, "
     "the engine tests run `workers run`"),
    (r"(\w+=\S+ )*\.venv/bin/python -m workers run .*",
     "trains the tiny model for minutes; the engine tests (tests/workers, marker `engine`) run `workers run`"),
    (r"\.venv/bin/python -m workers build-model .*",
     "trains a tokenizer and warm-starts a model for minutes; tests/workers/models/test_modelzoo.py builds every "
     "architecture briefly and tests/workers/models/test_model_zoo_engine.py runs RL on the full builds"),
    (r"export FLUXRL_CLUSTER_KEY=.*", "sets the shared key for a run over two machines (the next two commands)"),
    (r"\.venv/bin/python -m workers node .*",
     "joins a run on a second machine; tests/workers/cluster/test_two_node_run.py runs a node agent in its own process "
     "tree on loopback"),
    (r"for i in [\d ]+; do .*\.venv/bin/python -m workers run .*",
     "trains the demo several times in a row (minutes each); the engine tests run `workers run`"),
    (r"for v in [A-Z_ ]+; do", "writes a deployment's secrets into .env (with the next line); needs nothing to test"),
    (r'echo "\$v=\$\(openssl rand -hex 32\)"; done > \.env && chmod 600 \.env', "the loop's body (previous line)"),
    (r"docker compose .*",
     "needs a Docker engine, which CI machines lack; tests/test_deployment.py checks docker-compose.yml and the "
     "Dockerfile as files, and tests/platform/accounts/test_create_admin.py the create_admin command"),
    (r"\.venv/bin/python -m workers evaluate .*",
     "needs a finished run's final_model; tests/workers/models/test_model_zoo_engine.py makes the same evaluation"),
]
RUN_PROGRAMS = ("curl", "fluxrl")
LOCAL_URL = re.compile(r"https?://(?:127\.0\.0\.1|localhost):8000")
CLI_RUN_ID = re.compile(r"\bfluxrl\s+(\w+)\s+(\d+)\b")
API_RUN_ID = re.compile(r"/api/runs/(\d+)/(\w*)")


# --- reading the README ----------------------------------------------------------------


@dataclass
class Command:
    text: str       # the command, continuation lines joined, comment removed
    comment: str    # the comment after it, if any
    line: int       # where it starts in its document
    source: str = "README.md"  # the document, relative to the repository

    @property
    def program(self) -> str:
        words = [w for w in self.text.split() if not re.fullmatch(r"\w+=\S*", w)]  # skip VAR=value prefixes
        return words[0] if words else ""

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.text}"


def split_comment(line: str) -> tuple[str, str]:
    """`cmd args  # comment` -> ("cmd args", "comment"); a # inside quotes or a word stays."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def readme_commands(text: str, source: str = "README.md") -> list[Command]:
    """The commands of every fenced bash/sh/shell/console block, in order."""
    commands, language, pending, start = [], None, "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            if language is None:
                language = stripped[3:].strip().lower() or "-"
            else:
                language = None
            continue
        if language not in SHELL_LANGUAGES:
            continue
        line = raw[2:] if language == "console" and raw.startswith("$ ") else raw
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1].rstrip() + " "
            continue
        command, comment = split_comment((pending + line.strip()) if pending else line.strip())
        pending = ""
        if command:
            commands.append(Command(command, comment, start, source))
    return commands


def not_run_reason(command: Command) -> str | None:
    return next((reason for pattern, reason in NOT_RUN if re.fullmatch(pattern, command.text)), None)


@pytest.fixture(scope="module")
def commands() -> list[Command]:
    return [command for document in DOCUMENTS
            for command in readme_commands(document.read_text(encoding="utf-8"), str(document.relative_to(REPO)))]


def test_every_readme_command_is_run_or_deliberately_skipped(commands):
    unclassified = [str(c) for c in commands if c.program not in RUN_PROGRAMS and not_run_reason(c) is None]
    assert not unclassified, (
        "README and docs commands that are neither run by this test (curl, fluxrl) nor listed in NOT_RUN "
        "with a reason (tests/test_readme_commands.py):\n  " + "\n  ".join(unclassified))
    run_here = [c for c in commands if c.program in RUN_PROGRAMS]
    # The parser still finds what the README is known to document.
    assert any(c.program == "fluxrl" and " login " in f" {c.text} " for c in run_here), run_here
    assert any(c.program == "curl" and "application/yaml" in c.text for c in run_here), run_here


# --- the live run-through --------------------------------------------------------------


class Api:
    def __init__(self, base: str, key: str):
        self.base = base
        self.http = requests.Session()
        self.http.trust_env = False  # loopback: never through a proxy
        self.http.headers["Authorization"] = f"Bearer {key}"

    def request(self, method: str, path: str, **kwargs):
        response = self.http.request(method, self.base + path, timeout=30, **kwargs)
        assert response.status_code < 300, (method, path, response.status_code, response.text[:500])
        return response.json() if response.content else None

    def run(self, run_id: int) -> dict:
        return self.request("GET", f"/api/runs/{run_id}/")

    def submit(self, tags=("readme-setup",)) -> int:
        spec = (REPO / "examples" / "add-async.yaml").read_text()
        return self.request("POST", "/api/runs/", json={"spec": spec, "tags": list(tags)})["id"]

    def newest_run_id(self) -> int:
        results = self.request("GET", "/api/runs/", params={"limit": 1})["results"]
        return results[0]["id"] if results else 0

    def worker(self, run_id: int) -> "Api":
        """The run's engine: a run token from the endpoint the dispatcher uses."""
        return Api(self.base, self.request("POST", f"/api/runs/{run_id}/tokens/")["key"])


def engine_reports(api: Api, run_id: int, end: str = "succeeded", checkpoint: bool = False) -> None:
    """What an engine reports from start to end, without training."""
    worker = api.worker(run_id)
    status = f"/api/runs/{run_id}/status/"
    worker.request("POST", status, json={"status": "starting", "worker_host": "readme-test", "worker_pid": os.getpid()})
    worker.request("POST", status, json={"status": "running"})
    worker.request("POST", f"/api/runs/{run_id}/samples/", json={"samples": [
        {"uid": f"readme-{run_id}-1", "step": 1, "prompt": "12+30=", "completion": "42", "reward": 1.0,
         "versions": [0, 1]}]})
    if checkpoint:
        worker.request("POST", f"/api/runs/{run_id}/checkpoints/",
                       json={"step": 1, "version": 1, "path": "checkpoints/step-1"})
    worker.request("POST", status, json={"status": end, "failure_reason": "stand-in engine stopped" * (end == "failed")})


class StandInEngine(threading.Thread):
    """Waits (in a thread, while a command follows the run) for a run to be queued, then
    reports it to success. run_id None: the first run newer than `after`."""

    def __init__(self, api: Api, run_id: int | None = None, after: int = 0, timeout: float = 60):
        super().__init__(daemon=True)
        self.api, self.run_id, self.after, self.timeout = api, run_id, after, timeout
        self.error: str | None = None
        self.command_ended = threading.Event()  # a command that failed early leaves nothing to wait for

    def target(self) -> int | None:
        if self.run_id is None:
            newest = self.api.newest_run_id()
            return newest if newest > self.after else None
        return self.run_id if self.api.run(self.run_id)["status"] == "queued" else None

    def run(self):
        try:
            deadline = time.monotonic() + self.timeout
            while (run_id := self.target()) is None:
                if self.command_ended.is_set():
                    raise RuntimeError("the command ended before it queued a run")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no queued run to report on within {self.timeout:.0f} s")
                time.sleep(0.3)
            self.run_id = run_id
            engine_reports(self.api, run_id)
        except Exception as exc:  # reported by the test
            self.error = f"stand-in engine: {exc!r}"


@dataclass
class Session:
    server: LiveServer
    api: Api
    workdir: Path
    home: Path
    env: dict
    runs_seen: list[int] = field(default_factory=list)  # run ids printed by earlier commands


def run_with_state(session: Session, wanted) -> int | None:
    for run_id in session.runs_seen:
        try:
            if wanted(run_id):
                return run_id
        except AssertionError:
            continue
    return None


def prepare_run(session: Session, verb: str) -> int:
    """A run in the state a command that names one (README: 12) needs."""
    api = session.api
    if verb == "resume":  # failed, with a checkpoint to resume from
        run_id = api.submit()
        engine_reports(api, run_id, end="failed", checkpoint=True)
        return run_id
    if verb == "samples":
        run_id = run_with_state(session, lambda r: api.request("GET", f"/api/runs/{r}/samples/")["results"])
        if run_id is None:
            run_id = api.submit()
            engine_reports(api, run_id)
        return run_id
    # watch, cancel, and anything else about a run: a queued one
    run_id = run_with_state(session, lambda r: api.run(r)["status"] == "queued") or api.submit()
    session.runs_seen = [r for r in session.runs_seen if r != run_id]  # used up
    return run_id


def with_curl_status(text: str) -> str:
    """curl ... -> curl -sS --max-time T -w '<newline>HTTP <code>' ...: the status is read from the output."""
    return re.sub(r"^((?:\w+=\S+ )*)curl ", rf"\1curl -sS --max-time {COMMAND_TIMEOUT_S} -w '\\nHTTP %{{http_code}}' ",
                  text, count=1)


def bash(session: Session, text: str) -> tuple[int | None, str, str]:
    proc = subprocess.Popen(["bash", "-o", "pipefail", "-c", text], cwd=session.workdir, env=session.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session, started just above
        out, err = proc.communicate()
        return None, out, err + f"\n[timed out after {COMMAND_TIMEOUT_S} s]"
    return proc.returncode, out, err


def check_command(session: Session, command: Command) -> tuple[str, str | None]:
    """Run one README command: (the text run, None if it did what the README says, else what went wrong)."""
    text = LOCAL_URL.sub(session.server.url, command.text)
    problem = None
    try:
        text, problem = run_command(session, command, text)
    except Exception as exc:  # a broken placeholder or reply: reported with the command
        problem = f"{exc!r}"
    return text, problem


def run_command(session: Session, command: Command, text: str) -> tuple[str, str | None]:
    engine, is_curl = None, command.program == "curl"
    cli_id, api_id = CLI_RUN_ID.search(text), API_RUN_ID.search(text)
    if cli_id or api_id:
        verb = cli_id.group(1) if cli_id else (api_id.group(2) or "detail")
        run_id = prepare_run(session, verb)
        text = CLI_RUN_ID.sub(lambda m: f"fluxrl {m.group(1)} {run_id}", text)
        text = API_RUN_ID.sub(lambda m: f"/api/runs/{run_id}/{m.group(2)}", text)
        if "--watch" in text.split() or verb == "watch":  # follows the run to its end (after a resume: queued again)
            engine = StandInEngine(session.api, run_id)
    elif command.program == "fluxrl" and "--watch" in text.split():  # submit --watch: the run it creates
        engine = StandInEngine(session.api, after=session.api.newest_run_id())
    if is_curl:
        text = with_curl_status(text)
    if engine:
        engine.start()
    code, out, err = bash(session, text)
    if engine:
        engine.command_ended.set()
        engine.join(COMMAND_TIMEOUT_S)
    shown = f"\n  ran: {text}\n  exit {code}\n  stdout: {out[-1500:]}\n  stderr: {err[-1500:]}"
    if engine and engine.error and code == 0:
        return text, engine.error + shown

    if is_curl:
        body, _, status_line = out.rpartition("\n")
        status = int(status_line.split()[-1]) if status_line.startswith("HTTP ") else 0
        if code != 0 or not 200 <= status < 300:
            return text, f"curl failed (HTTP {status}){shown}"
        if re.search(r"application/(x-)?yaml|text/yaml", text) and "--data-binary" in text:
            run = json.loads(body)
            posted = re.search(r"--data-binary @(\S+)", text)
            name = re.search(r"^name:\s*(\S+)", (session.workdir / posted.group(1)).read_text(), re.M).group(1) \
                if posted else None
            if status != 201 or not isinstance(run.get("id"), int) or run.get("status") != "queued" \
                    or (name and run.get("name") != name):
                return text, f"the YAML submission did not answer 201 with a queued run named {name}{shown}"
        try:
            reply = json.loads(body) if body.strip() else None
        except ValueError:
            reply = None
        if isinstance(reply, dict) and isinstance(reply.get("id"), int) and "/api/runs/" in text:
            session.runs_seen.append(reply["id"])
        return text, None

    if code != 0:
        return text, f"fluxrl exited {code}{shown}"
    session.runs_seen += [int(n) for n in re.findall(r"^run (\d+) queued", out, re.M)]
    if engine is not None and engine.run_id is not None and f"run {engine.run_id} succeeded" not in out:
        return text, f"the command did not follow run {engine.run_id} to its end{shown}"
    stored = re.search(r"stored in ~/(\S+)", command.comment)
    if stored and not (session.home / stored.group(1)).is_file():
        return text, f"the README says the login is stored in ~/{stored.group(1)}; it is not there{shown}"
    output = re.search(r"(?:^|\s)-o\s+(\S+)", text)
    if output and not ((path := session.workdir / output.group(1)).is_file() and path.stat().st_size):
        return text, f"{output.group(1)} is missing or empty{shown}"
    return text, None


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    assert shutil.which("curl"), "curl is not installed (apt-get install curl): the README's curl commands are tested"
    venv_bin = Path(sys.executable).parent
    assert (venv_bin / "fluxrl").exists(), f"no `fluxrl` in {venv_bin}: run scripts/setup.sh (pip install -e .)"
    root = tmp_path_factory.mktemp("readme")
    workdir, home = root / "cwd", root / "home"
    workdir.mkdir()
    home.mkdir()
    for entry in REPO.iterdir():  # README paths are relative to the repository; what commands write lands here
        if entry.name != ".git":
            (workdir / entry.name).symlink_to(entry)
    with LiveServer(root / "server") as server:
        key = server.manage("bootstrap_demo").strip()
        env = {k: v for k, v in os.environ.items()
               if k not in ("FLUXRL_URL", "FLUXRL_TOKEN", "XDG_CONFIG_HOME", "TOKEN")}
        no_proxy = ",".join(filter(None, ["127.0.0.1,localhost", env.get("no_proxy")]))
        env.update(HOME=str(home), TOKEN=key, PATH=f"{venv_bin}{os.pathsep}{env.get('PATH', '')}",
                   no_proxy=no_proxy, NO_PROXY=no_proxy)
        yield Session(server, Api(server.url, key), workdir, home, env)


def test_readme_curl_and_fluxrl_commands_work_against_a_live_server(session, commands):
    to_run = [c for c in commands if c.program in RUN_PROGRAMS]
    failures, report = [], []
    for command in to_run:
        ran, problem = check_command(session, command)
        report.append(f"{'FAIL' if problem else 'ok  '}  {command}\n        ran: {ran}")
        if problem:
            failures.append(f"{command}\n  {problem}")
    print("\n".join(report))
    assert not failures, (
        f"{len(failures)} of {len(to_run)} README and docs commands do not work as written "
        "(fix the document, or this test if it fills in a placeholder wrongly):\n\n" + "\n\n".join(failures))
