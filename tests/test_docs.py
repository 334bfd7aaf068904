"""The project stands on its own: every design note a comment cites is in the repository,
with the section it names; every markdown file named anywhere exists; nothing cites the
old DESIGN.md kept outside the repository; the README's and docs' links point at files
that exist. Pages the documentation site writes at build time (docs/hooks/fluxrl_docs.py:
the spec and API references, the guides index) count as files of docs/."""
import importlib.util
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".sh", ".md", ".yaml", ".yml", ".js", ".css", ".html", ".txt", ".toml"}
CITATION = re.compile(r"\b((?:docs/)?[\w./-]+\.md)\s+§(\d+)")
MENTION = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-][\w.-]*\.md)\b")  # a markdown file named, cited or not
SELF_CITATION = re.compile(r"§(\d+)")  # left once citations of other files are removed: this note's own
URL = re.compile(r"\w+://\S+")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def generated_docs() -> set[Path]:
    """What the site's build hook adds to docs/ (tests/test_docs_site.py checks it is made)."""
    hook = importlib.util.spec_from_file_location("fluxrl_docs_hook", ROOT / "docs" / "hooks" / "fluxrl_docs.py")
    module = importlib.util.module_from_spec(hook)
    hook.loader.exec_module(module)
    return {(ROOT / "docs" / name).resolve() for name in module.generated_pages()}


GENERATED = generated_docs()


def exists(path: Path) -> bool:
    return path.exists() or path.resolve() in GENERATED


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    paths = [ROOT / n for n in names]
    return [p for p in paths if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name in ("Dockerfile", "run"))]


def sections(doc: Path) -> set[str]:
    return set(re.findall(r"^#+\s+(\d+)\.", doc.read_text(), re.M))


def test_every_cited_design_note_and_section_exists():
    problems = []
    for path in tracked_text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for doc, section in CITATION.findall(line):
                target = ROOT / doc
                where = f"{path.relative_to(ROOT)}:{number}"
                if not target.is_file():
                    problems.append(f"{where} cites {doc}, which is not in the repository")
                elif section not in sections(target):
                    problems.append(f"{where} cites {doc} §{section}, which has no such section")
    assert not problems, "\n".join(problems)


def test_every_mentioned_markdown_file_exists():
    this = Path(__file__).resolve()
    missing = []
    for path in tracked_text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if path.resolve() == this and "DESIGN.md" in line:
                continue  # the name this file forbids (next test)
            for name in MENTION.findall(URL.sub("", line)):
                site_file = path.name == "mkdocs.yml" or path.is_relative_to(ROOT / "docs")  # names pages from docs/
                if not (exists(ROOT / name) or exists(path.parent / name)
                        or (site_file and exists(ROOT / "docs" / name))):
                    missing.append(f"{path.relative_to(ROOT)}:{number} mentions {name}, which is not in the repository")
    assert not missing, "\n".join(missing)


def test_a_notes_references_to_its_own_sections_exist():
    problems = []
    for doc in sorted((ROOT / "docs").glob("*.md")):
        own = sections(doc)
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            line = CITATION.sub("", line)  # citations of other files are checked above
            for section in SELF_CITATION.findall(line):
                if section not in own:
                    problems.append(f"{doc.relative_to(ROOT)}:{number} refers to §{section}, which it does not have")
    assert not problems, "\n".join(problems)


def test_nothing_cites_design_notes_kept_outside_the_repository():
    this = Path(__file__).resolve()
    offenders = [str(p.relative_to(ROOT)) for p in tracked_text_files()
                 if p.resolve() != this and "DESIGN.md" in p.read_text(errors="replace")]
    assert not offenders, offenders


def test_relative_links_in_the_readme_and_docs_point_at_files():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for doc in docs:
        for target in LINK.findall(doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not exists(doc.parent / target):
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_the_architecture_notes_are_cited_by_the_code():
    # They exist for the code: a note nothing cites would drift unread.
    cited = {section for p in tracked_text_files() if p.suffix != ".md"
             for doc, section in CITATION.findall(p.read_text(errors="replace")) if doc == "docs/architecture.md"}
    assert {"2", "4", "5", "7"} <= cited, cited


# A page or a comment says what the code is; what it was belongs in docs/changelog.md (and
# in git log). "used to" as history ("it used to send one blob"), not as purpose ("a key
# used to sign"): not after a form of "be" or "get".
DIARY = re.compile(r"(?<!\bis )(?<!\bare )(?<!\bwas )(?<!\bwere )(?<!\bbe )(?<!\bbeen )(?<!\bbeing )(?<!\bgets )"
                   r"(?<!\bget )\bused to\b|\bbefore this change\b|\bissue #?\d+|\bas of this (?:change|commit)\b",
                   re.I)
HISTORY_FILES = {"docs/changelog.md"}


def test_docs_and_code_describe_what_is_not_what_was():
    found = []
    for path in tracked_text_files():
        name = path.relative_to(ROOT).as_posix()
        if name in HISTORY_FILES or name.startswith(("bench/results/", "tests/test_docs.py")):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if DIARY.search(line):
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not found, "history in the docs or comments (it belongs in docs/changelog.md):\n" + "\n".join(found)
