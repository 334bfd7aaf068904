"""exit_with_parent: a child ends soon after its launcher, even one that died before the
child started its watch (SIGKILLed while the child was still importing)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")
REPO = Path(__file__).resolve().parents[3]

# The child: sleeps (standing for a slow import) so that its launcher is gone before it
# starts the watch, then waits to be ended by it.
CHILD = """
import os, sys, time
time.sleep(float(sys.argv[1]))
from workers.io.lifetime import LAUNCHER_ENV, exit_with_parent
exit_with_parent(code=3)
print(LAUNCHER_ENV in os.environ, flush=True)
time.sleep(60)
"""

# The launcher: starts the child with launcher_env, says its pid, and exits at once.
LAUNCHER = """
import json, os, subprocess, sys
from workers.io.lifetime import launcher_env
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], cwd=sys.argv[3],
                         env={**os.environ, **launcher_env()}, stdout=open(sys.argv[4], "w"), stderr=subprocess.STDOUT)
print(json.dumps({"child": child.pid}), flush=True)
os._exit(0)
"""


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def launch_and_orphan(delay_s: float, out: Path) -> int:
    launcher = subprocess.run([sys.executable, "-c", LAUNCHER, CHILD, str(delay_s), str(REPO), str(out)],
                              cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(launcher.stdout)["child"]


def test_a_child_whose_launcher_died_before_its_watch_started_still_exits(tmp_path):
    child = launch_and_orphan(2.0, tmp_path / "out")
    try:
        assert not gone(child), (tmp_path / "out").read_text()  # still "importing": the launcher is gone
        deadline = time.monotonic() + 15
        while not gone(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(child), "the orphan lived on"
    finally:
        if not gone(child):
            os.kill(child, 9)


def test_the_launchers_pid_is_not_passed_on_to_the_childs_own_children():
    from workers.io.lifetime import launcher_env

    child = subprocess.Popen([sys.executable, "-c", CHILD, "0"], cwd=REPO, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, **launcher_env()})  # this process launches it, and lives on
    try:
        assert child.stdout.readline().strip() == "False"  # what its own children would inherit
        assert child.poll() is None  # its launcher lives: the watch leaves it be
    finally:
        child.kill()
        child.wait()
