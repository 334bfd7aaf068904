"""scripts/engine_imports.py finds every import a package makes, the lazy ones inside functions
too, and fails on one that does not import here, naming the file and line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_check(root: Path, package: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "engine_imports.py"), "--root", str(root),
                           "--package", package, "--json", str(out)], capture_output=True, text=True, timeout=120)


def test_a_lazy_import_of_a_missing_package_or_name_fails_and_optional_ones_do_not(tmp_path):
    pkg = tmp_path / "probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import json\n")
    (pkg / "engine.py").write_text(
        "def start():\n"
        "    import fluxrl_not_installed_anywhere\n"      # lazy, missing: fails
        "    from json import no_such_name\n"             # stdlib: not checked
        "    from email.mime import text\n"               # stdlib
        "    from zipfile import ZipFile\n"
        "def report():\n"
        "    try:\n"
        "        import fluxrl_optional_thing\n"           # inside try/except ImportError: optional
        "    except ImportError:\n"
        "        pass\n"
        "    import fluxrl_exporter_thing  # extra: exporters\n"
        "    from pytest import no_such_pytest_name\n")    # a missing name in a present package: fails
    result = run_check(tmp_path, "probe_pkg", tmp_path / "out.json")
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((tmp_path / "out.json").read_text())
    by_statement = {i["statement"]: i for i in report["imports"]}
    assert set(by_statement) == {"import fluxrl_not_installed_anywhere", "import fluxrl_optional_thing",
                                 "import fluxrl_exporter_thing", "from pytest import no_such_pytest_name"}
    missing = by_statement["import fluxrl_not_installed_anywhere"]
    assert missing["where"] == ["probe_pkg/engine.py:2"] and not missing["optional"]
    assert "No module named 'fluxrl_not_installed_anywhere'" in missing["error"]
    assert by_statement["import fluxrl_optional_thing"]["optional"]
    assert by_statement["import fluxrl_exporter_thing"]["optional"]
    assert "cannot import name 'no_such_pytest_name' from 'pytest'" in by_statement[
        "from pytest import no_such_pytest_name"]["error"]
    assert report["modules"] == {"probe_pkg": None, "probe_pkg.engine": None}
    assert "2 failed" in result.stdout


def test_every_import_the_engine_makes_succeeds_in_the_project_environment(tmp_path):
    result = run_check(ROOT, "workers", tmp_path / "out.json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "out.json").read_text())
    statements = {i["statement"] for i in report["imports"]}
    # the lazy vLLM and DeepSpeed imports are found, not only the top-level ones
    assert "from vllm.v1.engine.async_llm import AsyncLLM" in statements
    assert "import deepspeed" in statements
