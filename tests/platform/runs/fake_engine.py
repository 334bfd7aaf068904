"""Stands in for `python -m workers` in the dispatch tests (FLUXRL_ENGINE_COMMAND), so
they exercise real processes without starting vLLM. FAKE_ENGINE_MODE says what to do:
ok (exit 0), slow (sleep FAKE_ENGINE_SECONDS, default 0.5, then exit 0), fail (print,
exit 3), crash (start a child, then SIGKILL itself), stubborn (start a child, ignore
SIGTERM, never end). Children ignore SIGTERM, as a wedged vLLM engine process might.
It records its arguments, environment and start time in OUT/call.json, and the time
it ended in OUT/ended when it exits 0."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CHILD = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def node(args: list[str]) -> int:
    """`node --rendezvous HOST:PORT --node-rank R`: records its call in FAKE_NODE_OUT, then
    FAKE_NODE_MODE: wait (until stopped) or fail (exit 3)."""
    import hashlib

    out = Path(os.environ["FAKE_NODE_OUT"])
    rank = args[args.index("--node-rank") + 1]
    key = os.environ.get("FLUXRL_CLUSTER_KEY", "")
    (out / f"node-{rank}.json").write_text(json.dumps({
        "argv": args, "pid": os.getpid(), "pgid": os.getpgid(0), "env": sorted(os.environ),
        "key_sha": hashlib.sha256(key.encode()).hexdigest() if key else None}))
    print(f"node {rank}: joining", flush=True)
    if os.environ.get("FAKE_NODE_MODE", "wait") == "fail":
        print("error: node rank 1 could not start its trainer rank", flush=True)
        return 3
    time.sleep(600)
    return 0


def main() -> int:
    args = sys.argv[1:]
    if args[0] == "node":
        return node(args)
    out = Path(args[args.index("--out") + 1])
    out.mkdir(parents=True, exist_ok=True)
    key = os.environ.get("FLUXRL_CLUSTER_KEY", "")
    (out / "call.json").write_text(json.dumps({"argv": args, "env": sorted(os.environ), "pid": os.getpid(),
                                               "key_sha": __import__("hashlib").sha256(key.encode()).hexdigest()
                                               if key else None,
                                               "pgid": os.getpgid(0), "cwd": os.getcwd(), "started": time.time(),
                                               "run_token": os.environ.get("FLUXRL_RUN_TOKEN")}))
    mode = os.environ.get("FAKE_ENGINE_MODE", "ok")
    print("engine: starting", flush=True)
    if mode in ("ok", "slow"):
        time.sleep(float(os.environ.get("FAKE_ENGINE_SECONDS", "0.5")) if mode == "slow" else 0)
        (out / "ended").write_text(str(time.time()))
        return 0
    if mode == "fail":
        print("loading the model\rloading the model: done\nerror: the dataset is empty", flush=True)
        return 3
    child = subprocess.Popen([sys.executable, "-c", CHILD])
    (out / "child.pid").write_text(str(child.pid))
    if mode == "crash":
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    (out / "ready").touch()
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
