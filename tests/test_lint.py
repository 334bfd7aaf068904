"""`ruff check .` finds nothing: the rules in pyproject.toml's [tool.ruff.lint] (syntax
errors, pyflakes' unused and undefined names, mutable or call-made argument defaults) hold
over the whole tree. A name imported for a side effect or to be re-exported says so with
`__all__` or a `# noqa: F401` that gives the reason."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
