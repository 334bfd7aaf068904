"""A PATH like this machine's, less one program: the sandbox's probe then meets a machine
without it for real (shutil.which, the shell), with no mock in between."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from workers.rewards.sandbox_boundary import UNSAFE_ENV, forget_status

MISSING = "reward code cannot be contained on this machine: bubblewrap is not installed (apt-get install bubblewrap)"


def path_without(program: str, folder: Path) -> str:
    """Make ``folder`` hold a link to every program on PATH except ``program``; return it
    as a PATH of one entry."""
    folder.mkdir(parents=True, exist_ok=True)
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(entry):
            continue
        for name in os.listdir(entry):
            target, link = os.path.join(entry, name), folder / name
            if name != program and not link.exists() and not link.is_symlink() and os.access(target, os.X_OK):
                link.symlink_to(target)
    return str(folder)


@pytest.fixture(autouse=True)
def fresh_probe(monkeypatch):
    """Each test probes anew (the probe's answer is cached per process), without the unsafe opt-in."""
    monkeypatch.delenv(UNSAFE_ENV, raising=False)
    forget_status()
    yield
    forget_status()  # later tests probe with the real PATH again


@pytest.fixture
def no_bwrap(monkeypatch, tmp_path) -> str:
    """This machine, less bubblewrap: the PATH, which is returned, has every program but bwrap."""
    path = path_without("bwrap", tmp_path / "bin")
    monkeypatch.setenv("PATH", path)
    return path
