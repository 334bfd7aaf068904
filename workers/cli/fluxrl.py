"""fluxrl: the command-line client of a FluxRL platform (REST API + live websocket).

  fluxrl login --url http://127.0.0.1:8000 --token flxu_...   stored in ~/.config/fluxrl/config.json
  fluxrl submit examples/add-async.yaml [--tag demo] [--team T] [--watch]
  fluxrl runs [--status running] [--tag demo]
  fluxrl watch RUN              live progress until the run ends (exit 0 if it succeeded)
  fluxrl cancel RUN
  fluxrl resume RUN [--watch]   a failed or cancelled run again, from its newest checkpoint
  fluxrl samples RUN [-o samples.jsonl] [--since-step N]

FLUXRL_URL and FLUXRL_TOKEN, when set, win over the stored login.
Exit codes: 0 ok, 1 the watched run failed or was cancelled, 2 usage or API error, 130 interrupted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import requests

from workers.io.client import TERMINAL_STATUSES, ApiError, FluxClient

POSTFIX_KEYS = {"reward": "reward/mean", "samples/s": "throughput/samples_per_s", "stale": "staleness/mean",
                "acc": "eval/accuracy"}


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "fluxrl" / "config.json"


def load_login() -> tuple[str, str]:
    path = config_path()
    stored = json.loads(path.read_text()) if path.exists() else {}
    url, token = os.environ.get("FLUXRL_URL") or stored.get("url"), os.environ.get("FLUXRL_TOKEN") or stored.get("token")
    if not url or not token:
        raise SystemExit("error: not logged in; run `fluxrl login --url URL --token TOKEN` (or set FLUXRL_URL, FLUXRL_TOKEN)")
    return url, token


def save_login(url: str, token: str) -> Path:
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)  # the token is a password: readable by its owner only
    path.write_text(json.dumps({"url": url, "token": token}, indent=2))
    return path


class RunProgress:
    """What `fluxrl watch` shows, fed with the run's live messages."""

    def __init__(self, total_steps: int | None = None):
        self.total = total_steps
        self.step = 0
        self.status = None
        self.failure_reason = ""
        self.latest: dict[str, tuple[int, float]] = {}  # key -> (step, value)

    def update(self, message: dict) -> None:
        if message.get("type") == "status":
            self.status = message["status"]
            self.failure_reason = message.get("failure_reason") or ""
        elif message.get("type") == "metrics":
            for point in message.get("points", []):
                self.step = max(self.step, point["step"])
                if point["step"] >= self.latest.get(point["key"], (-1, 0))[0]:  # a batch may be pushed again
                    self.latest[point["key"]] = (point["step"], point["value"])

    @property
    def done(self) -> bool:
        return self.status in TERMINAL_STATUSES

    def postfix(self) -> dict[str, str]:
        return {label: f"{self.latest[key][1]:.3g}" for label, key in POSTFIX_KEYS.items() if key in self.latest}


def watch(client: FluxClient, run_id: int) -> int:
    from tqdm import tqdm

    run = client.run(run_id)
    total = ((run.get("resolved_spec") or {}).get("stop") or {}).get("max_steps")
    progress = RunProgress(total)
    bar = tqdm(total=total, unit="step", desc=f"run {run_id}", dynamic_ncols=True)

    async def follow():
        async for message in client.events(run_id):
            progress.update(message)
            bar.n = min(progress.step, total) if total else progress.step
            bar.set_description(f"run {run_id} {progress.status}", refresh=False)
            bar.set_postfix(progress.postfix(), refresh=False)
            bar.refresh()
            if progress.done:
                return

    try:
        asyncio.run(follow())
    except KeyboardInterrupt:
        bar.close()
        print(f"stopped watching; the run goes on (fluxrl cancel {run_id} stops it)", file=sys.stderr)
        return 130
    bar.close()
    print(f"run {run_id} {progress.status}" + (f": {progress.failure_reason}" if progress.failure_reason else ""))
    return 0 if progress.status == "succeeded" else 1


def print_run_links(client: FluxClient, run: dict) -> None:
    print(f"run {run['id']} {run['status']}: {run['name']}")
    print(f"  dashboard: {client.url}/runs/{run['id']}/")
    print(f"  API:       {client.url}/api/runs/{run['id']}/")


def cmd_login(args) -> int:
    client = FluxClient(args.url, args.token)
    me = client.me()
    path = save_login(args.url.rstrip("/"), args.token)
    teams = ", ".join(t["slug"] for t in me["teams"]) or "none"
    print(f"logged in to {client.url} as {me['username']} (teams: {teams}); saved in {path}")
    return 0


def cmd_submit(client: FluxClient, args) -> int:
    run = client.submit(Path(args.spec).read_text(), tags=args.tag, notes=args.notes, team=args.team)
    print_run_links(client, run)
    return watch(client, run["id"]) if args.watch else 0


def cmd_runs(client: FluxClient, args) -> int:
    runs = client.runs(status=args.status, tag=args.tag, team=args.team)
    print(f"{'ID':>6}  {'STATUS':<10} {'CREATED':<20} {'NAME':<30} TAGS")
    for run in runs:
        print(f"{run['id']:>6}  {run['status']:<10} {run['created_at'][:19]:<20} {run['name'][:30]:<30} {','.join(run['tags'])}")
    return 0


def cmd_cancel(client: FluxClient, args) -> int:
    run = client.cancel(args.run)
    state = run["status"] if run["status"] in TERMINAL_STATUSES else f"{run['status']}, stopping"
    print(f"run {args.run}: cancel requested ({state})")
    return 0


def cmd_resume(client: FluxClient, args) -> int:
    run = client.resume(args.run)
    print(f"run {args.run}: queued again, to resume from its newest checkpoint ({run['status']})")
    return watch(client, args.run) if args.watch else 0


def cmd_samples(client: FluxClient, args) -> int:
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    count = 0
    try:
        for sample in client.samples(args.run, args.since_step):
            out.write(json.dumps(sample) + "\n")
            count += 1
    finally:
        if args.output:
            out.close()
            print(f"{count} samples written to {args.output}", file=sys.stderr)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fluxrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    login = sub.add_parser("login", help="check and store the platform URL and your API token")
    login.add_argument("--url", required=True)
    login.add_argument("--token", required=True, help="a user API token (flxu_...)")
    submit = sub.add_parser("submit", help="submit a run spec (YAML or JSON)")
    submit.add_argument("spec")
    submit.add_argument("--tag", action="append", default=[])
    submit.add_argument("--notes", default="")
    submit.add_argument("--team", help="team slug (needed if you are in several)")
    submit.add_argument("--watch", action="store_true", help="then watch it until it ends")
    runs = sub.add_parser("runs", help="list your teams' runs")
    runs.add_argument("--status", help="e.g. running, or queued,starting,running")
    runs.add_argument("--tag")
    runs.add_argument("--team")
    for name, text in (("watch", "follow a run live until it ends"), ("cancel", "stop a run")):
        sub.add_parser(name, help=text).add_argument("run", type=int)
    resume = sub.add_parser("resume", help="run a failed or cancelled run on from its newest checkpoint")
    resume.add_argument("run", type=int)
    resume.add_argument("--watch", action="store_true", help="then watch it until it ends")
    samples = sub.add_parser("samples", help="download a run's samples as JSON lines")
    samples.add_argument("run", type=int)
    samples.add_argument("-o", "--output", help="file (default: stdout)")
    samples.add_argument("--since-step", type=int)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.cmd == "login":
            return cmd_login(args)
        client = FluxClient(*load_login())
        commands = {"submit": cmd_submit, "runs": cmd_runs, "cancel": cmd_cancel, "resume": cmd_resume,
                    "samples": cmd_samples}
        return watch(client, args.run) if args.cmd == "watch" else commands[args.cmd](client, args)
    except ApiError as exc:
        fields = "".join(f"\n  {field}: {message}" for field, message in exc.fields.items())
        print(f"error: {exc.message} ({exc.status} {exc.code}){fields}", file=sys.stderr)
    except requests.ConnectionError as exc:
        print(f"error: cannot reach the platform: {exc}", file=sys.stderr)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
