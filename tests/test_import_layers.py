"""Import direction, read from the source (every import statement, function-local and
TYPE_CHECKING ones included): in workers/ a package imports only packages in lower
layers, in platform/fluxrl/ a unit (an app's domain modules, its api/ views, ...) imports
only units in lower layers, and neither workers/ nor platform/fluxrl/ has an import
circle between modules.

The layers are written down here and in each package's __init__ docstring."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# workers/, lowest first. Packages in one layer do not import each other (rollout and
# train meet only in coord).
WORKER_LAYERS = [
    ["workers.io", "workers.tasks"],
    ["workers.spec", "workers.agents.api"],
    ["workers.rewards", "workers.weights"],
    ["workers.models"],
    ["workers.rollout", "workers.train"],
    ["workers.cluster", "workers.agents"],
    ["workers.api"],
    ["workers.coord"],
    ["workers.cli"],
    ["workers.__main__"],
]

# platform/fluxrl/, lowest first (docs/architecture.md §6). A unit is a dotted prefix and
# a module belongs to the longest that matches, so "fluxrl.runs.api" sits above
# "fluxrl.runs". Helpers without Django models; then each app's domain modules (models,
# services, tasks, ...) in the order the apps build on each other; then the API's shared
# base; then what serves requests (views, consumers), routing and the server entry points.
# Domain modules never import those upper layers.
PLATFORM_LAYERS = [
    ["fluxrl.errors", "fluxrl.validation", "fluxrl.safe_yaml", "fluxrl.settings", "fluxrl.celery"],
    ["fluxrl.versioned", "fluxrl.archives"],
    ["fluxrl.accounts"],
    ["fluxrl.quotas"],
    ["fluxrl.datasets", "fluxrl.modelstore"],
    ["fluxrl.rewards", "fluxrl.environments"],
    ["fluxrl.runs"],
    ["fluxrl.metrics"],
    ["fluxrl.dashboard"],
    ["fluxrl.api", "fluxrl.accounts.authentication"],
    ["fluxrl.accounts.api", "fluxrl.quotas.api", "fluxrl.datasets.api", "fluxrl.modelstore.api", "fluxrl.rewards.api", "fluxrl.environments.api",
     "fluxrl.runs.api",
     "fluxrl.runs.consumers",
     "fluxrl.accounts.websocket_auth"],
    ["fluxrl.metrics.api"],
    ["fluxrl.dashboard.views"],
    ["fluxrl.api.urls", "fluxrl.dashboard.urls", "fluxrl.routing", "fluxrl.urls"],
    ["fluxrl.asgi", "fluxrl.wsgi"],
]


def modules(folder: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under folder (migrations left out)."""
    found = {}
    for path in folder.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        parts = list(path.relative_to(folder.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The known modules that module ``name`` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    # "from workers.io import wire" names the module workers.io.wire; a parent package
    # named only on the way to a submodule is not an import of its __init__ as well
    hits = {n for n in names if n in known and n != name}
    return {h for h in hits if not any(o.startswith(h + ".") for o in hits)}


def graph(folder: Path) -> dict[str, set[str]]:
    found = modules(folder)
    return {name: imported(name, path, set(found)) for name, path in found.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, result = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return result


def unit(module: str, units: list[str]) -> str | None:
    """The layered unit a module belongs to (the longest matching prefix)."""
    best = None
    for u in units:
        if (module == u or module.startswith(u + ".")) and (best is None or len(u) > len(best)):
            best = u
    return best


def layer_violations(edges: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    level = {u: i for i, row in enumerate(layers) for u in row}
    bad = []
    for a, targets in sorted(edges.items()):
        ua = unit(a, list(level))
        for b in sorted(targets):
            ub = unit(b, list(level))
            if ua is None or ub is None or ua == ub:
                continue
            if level[ub] >= level[ua]:
                bad.append(f"{a} imports {b}: {ua} (layer {level[ua]}) may not import {ub} (layer {level[ub]})")
    return bad


def test_every_worker_module_has_a_layer():
    units = [u for row in WORKER_LAYERS for u in row]
    homeless = [m for m in modules(ROOT / "workers") if m != "workers" and unit(m, units) is None]
    assert homeless == [], f"add these to a layer in WORKER_LAYERS (and a package): {homeless}"


def test_worker_packages_import_only_lower_layers():
    assert layer_violations(graph(ROOT / "workers"), WORKER_LAYERS) == []


@pytest.mark.parametrize("folder", ["workers", "platform/fluxrl"])
def test_no_import_circles(folder):
    assert circles(graph(ROOT / folder)) == []


def test_the_checker_finds_an_upward_import_and_a_circle():
    edges = {"workers.io.wire": {"workers.coord.controller"}, "workers.coord.controller": {"workers.io.wire"},
             "workers.train.trainer": {"workers.rollout.engine"}, "workers.rollout.engine": set()}
    assert circles(edges) == [["workers.coord.controller", "workers.io.wire"]]
    assert layer_violations(edges, WORKER_LAYERS) == [
        "workers.io.wire imports workers.coord.controller: workers.io (layer 0) may not import workers.coord (layer 7)",
        "workers.train.trainer imports workers.rollout.engine: workers.train (layer 4) may not import workers.rollout "
        "(layer 4)"]


def test_worker_packages_say_what_they_own():
    for init in sorted((ROOT / "workers").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "import" in doc, f"{init.relative_to(ROOT)}: say what the package owns and what it may import"


def test_every_platform_module_has_a_layer():
    units = [u for row in PLATFORM_LAYERS for u in row]
    # "fluxrl" itself (its __init__ loads the Celery app) is the prefix of every unit
    homeless = [m for m in modules(ROOT / "platform/fluxrl") if m != "fluxrl" and unit(m, units) is None]
    assert homeless == [], f"add these to a layer in PLATFORM_LAYERS: {homeless}"


def test_platform_modules_import_only_lower_layers():
    assert layer_violations(graph(ROOT / "platform/fluxrl"), PLATFORM_LAYERS) == []


def test_the_platform_layers_refuse_a_service_that_imports_the_api_or_a_higher_app():
    edges = {"fluxrl.runs.services": {"fluxrl.api.parsers", "fluxrl.metrics.models"},
             "fluxrl.metrics.services": {"fluxrl.runs.live"}, "fluxrl.runs.api.views": {"fluxrl.runs.services"}}
    assert layer_violations(edges, PLATFORM_LAYERS) == [
        "fluxrl.runs.services imports fluxrl.api.parsers: fluxrl.runs (layer 6) may not import fluxrl.api (layer 9)",
        "fluxrl.runs.services imports fluxrl.metrics.models: fluxrl.runs (layer 6) may not import fluxrl.metrics "
        "(layer 7)"]
