"""scripts/sandbox-deps.sh (run by scripts/setup.sh): the reward sandbox's Debian packages.
Quiet and successful when they are there; where it may not install them, it prints the one
command to run and still succeeds, so the setup goes on. "Missing" is a PATH without bwrap,
"may not install" a real unprivileged user (setpriv) with no sudo on PATH."""
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.sandbox_path import path_without

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sandbox-deps.sh"
NOBODY = 65534


def test_quiet_and_successful_when_the_sandbox_packages_are_present():
    assert shutil.which("bwrap"), "this machine lacks bubblewrap: run scripts/setup.sh"
    out = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to become another user")
def test_without_bubblewrap_and_without_sudo_it_prints_the_command_and_succeeds():
    folder = Path(tempfile.mkdtemp(prefix="fluxrl-deps-"))  # readable by the unprivileged user
    try:
        folder.chmod(0o755)
        script = folder / "sandbox-deps.sh"
        shutil.copy(SCRIPT, script)
        script.chmod(0o755)
        path = path_without("bwrap", folder / "bin")
        (folder / "bin" / "sudo").unlink(missing_ok=True)  # a user who may not install
        out = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", str(script)],
                             capture_output=True, text=True, timeout=60, env={"PATH": path, "LANG": "C.UTF-8"})
    finally:
        shutil.rmtree(folder)
    assert out.returncode == 0
    assert out.stdout == ""
    assert out.stderr == "setup: reward code needs the sandbox's bubblewrap; run: sudo apt-get install -y bubblewrap\n"
