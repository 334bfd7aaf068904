"""The documentation site builds with `mkdocs build --strict` (a broken link, a missing page or a
nav entry without its file fails the test command that CI runs), and the pages generated at
build time come from their one source: every field of workers/spec/ in the spec reference,
every operation of the OpenAPI schema in the API reference, every docs/guides/*.md in the Guides
section. The README stays a newcomer's page, and nothing in the repository reads like a diary."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from workers import spec

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "docs" / "hooks" / "fluxrl_docs.py"
README_MAX_LINES = 300


def hook_module():
    loaded = importlib.util.spec_from_file_location("fluxrl_docs_hook", HOOK)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                             str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    problems = [line for line in (result.stdout + result.stderr).splitlines()
                if line.startswith(("WARNING", "ERROR")) or "Aborted" in line]
    assert result.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(problems or [result.stderr[-3000:]])
    return out


def page_text(site: Path, name: str) -> str:
    html = (site / name / "index.html").read_text(encoding="utf-8")
    return re.sub(r"<[^>]+>", " ", html)


def spec_fields(model, prefix: str = "") -> set[str]:
    """Every dotted field of a spec model, nested models (also in lists and unions) included."""
    from pydantic import BaseModel

    found = set()
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        found.add(dotted)
        stack = [field.annotation]
        while stack:
            tp = stack.pop()
            if isinstance(tp, type) and issubclass(tp, BaseModel):
                found |= spec_fields(tp, dotted + ".")
            else:
                stack.extend(getattr(tp, "__args__", ()))
    return found


def test_the_site_builds_strict_and_has_every_page_of_the_nav(site):
    for page in ["getting-started", "concepts", "engine", "spec", "spec-reference", "models", "api",
                 "api-reference", "configuration", "deployment", "security", "benchmarks", "results",
                 "architecture", "development", "changelog", "guides"]:
        assert (site / page / "index.html").is_file(), page
    assert (site / "index.html").is_file()
    assert (site / "assets" / "architecture.svg").is_file()


def test_the_spec_reference_lists_every_field_of_workers_spec(site):
    text = page_text(site, "spec-reference").replace("[]", "")  # eval.sets[].name is eval.sets.name
    shown = set(text.split())
    missing = sorted(f for f in spec_fields(spec.RunSpec) if f not in shown)
    assert not missing, f"fields of workers/spec/ missing from the spec reference: {missing}"
    assert "rollout.update_mode" in text and "schedule.max_staleness" in text


def test_the_api_reference_lists_every_operation_of_the_openapi_schema(site):
    schema = hook_module().openapi_schema()
    text = page_text(site, "api-reference")
    operations = [f"{method.upper()} {path}" for path, item in schema["paths"].items() for method in item
                  if method in ("get", "post", "put", "patch", "delete")]
    assert len(operations) > 20
    missing = [op for op in operations if op not in text]
    assert not missing, f"operations of the OpenAPI schema missing from the API reference: {missing}"


def test_every_guide_is_in_the_site_and_its_navigation(site):
    guides = sorted(p for p in (ROOT / "docs" / "guides").glob("*.md") if p.stem != "index")
    index = page_text(site, "guides")
    home = (site / "index.html").read_text(encoding="utf-8")
    for guide in guides:
        assert (site / "guides" / guide.stem / "index.html").is_file(), guide.name
        assert f"guides/{guide.stem}/" in home, f"{guide.name} is not in the navigation"
        assert hook_module().guide_title(guide) in index, f"{guide.name} is not listed on the guides page"


def test_the_readme_is_short_and_points_into_the_docs():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"
    text = "\n".join(lines)
    for target in ("docs/getting-started.md", "docs/concepts.md", "docs/deployment.md", "docs/benchmarks.md",
                   "docs/assets/architecture.svg", "docs/assets/dashboard.png"):
        assert f"]({target}" in text, target


def test_nothing_in_the_repository_reads_like_a_development_diary():
    found = subprocess.run(["git", "grep", "-niE", r"session [0-9]|stop [0-9]"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    untracked = subprocess.run(["git", "ls-files", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split()
    diary = re.compile(r"session [0-9]|stop [0-9]", re.I)
    for name in untracked:
        path = ROOT / name
        if path.suffix in {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".js", ".html"} and path.is_file():
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if diary.search(line):
                    found += f"\n{name}:{number}:{line}"
    assert not found.strip(), "figures are dated by commit, not by the round of work that made them:\n" + found
