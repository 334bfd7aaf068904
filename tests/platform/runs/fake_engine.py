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


def main() -> int:
    args = sys.argv[1:]
    out = Path(args[args.index("--out") + 1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "call.json").write_text(json.dumps({"argv": args, "env": sorted(os.environ), "pid": os.getpid(),
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
