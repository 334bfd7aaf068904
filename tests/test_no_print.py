"""No print() in workers/ outside workers/cli/ (ruff's T20 rule, read here with ast so that
no linter is needed): engine diagnostics go through `logging`, which workers/cli/engine.py
sends to stderr, the run's engine.log on the dashboard. Only a CLI's answer to its user is
printed. A "print(" inside a string (a command line shown to the user, a child's script)
is not a call and is fine."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "workers"
ALLOWED = [WORKERS / "cli"]  # a CLI's answer to its user


def print_calls(source: str, filename: str = "<snippet>") -> list[int]:
    """Line numbers of the print(...) calls in source (also builtins.print(...))."""
    lines = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (isinstance(func, ast.Name) and func.id == "print") or (
                isinstance(func, ast.Attribute) and func.attr == "print"
                and isinstance(func.value, ast.Name) and func.value.id == "builtins"):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_checker_finds_a_print_call_and_not_one_in_a_string():
    assert print_calls("import sys\ndef f(x):\n    if x:\n        print(x, file=sys.stderr)\n") == [4]
    assert print_calls("import builtins\nbuiltins.print('a')\n") == [2]
    assert print_calls("cmd = \"python -c 'print(1)'\"\nlog.info('print(%s)', cmd)\n") == []
    assert print_calls("console.print('a')\nself.print = None\n") == []  # not the builtin


def test_workers_log_rather_than_print_outside_the_cli():
    files = [p for p in sorted(WORKERS.rglob("*.py")) if not any(p.is_relative_to(a) for a in ALLOWED)]
    assert len(files) > 20  # the walk found the package
    found = [f"{p.relative_to(ROOT)}:{line}" for p in files for line in print_calls(p.read_text(), str(p))]
    assert not found, ("print() outside workers/cli/: use logging.getLogger(__name__) instead "
                       "(a CLI's answer to its user belongs in workers/cli/):\n  " + "\n  ".join(found))
