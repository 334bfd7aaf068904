"""Where the benchmark figures come from. Every results file that the README and
docs/benchmarks.md cite exists; every README figure and every docs/benchmarks.md section
with figures cites one, except the older figures listed below, which were measured before
results files were kept for them (the list may only shrink); a results file written with a
``meta`` block (bench/vs_trl.py's and any bench's from now on) gives the date, commit,
machine and exact command; and the TRL matrix's table quotes its results file's figures."""
import datetime
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
README = REPO / "README.md"
BENCHMARKS = REPO / "docs/benchmarks.md"

CITATION = re.compile(r"bench/results/[\w.*+-]+")
# a figure: a ratio (1.11×), a measure (841 samples/s, 15.8 ms), a share or an accuracy (0.630), or
# a table cell that is a number
FIGURE = re.compile(r"\d(?:[\d,]*\.?\d*)\s*×|\d[\d,]*(?:\.\d+)?\s*(?:samples|tokens|ms\b|GiB|%)|\b0\.\d{2,}\b"
                    r"|^\|.*\|\s*\**\d", re.M)

# README bullets (under "What it measures", by their bold lead) whose figures no results file holds
README_WITHOUT_RESULTS = {
    "The default spec on models FluxRL did not build",
    "The host-memory plan against measured peaks",
    "Asynchronous against synchronous RL",
    "In-flight weight updates",
    "Learning, with controls",
    "LoRA RL",
    "The platform",
}
# docs/benchmarks.md sections (by heading) whose figures no results file holds
BENCHMARKS_WITHOUT_RESULTS = {
    "FluxRL's own settings, side by side",
    "Against the plain loop, before one request per group",
    "Sync against async",
    "The stall of an in-flight update",
    "Weights over a collective against the RPC",
    "Evaluation sampling",
    "The trainer on an accelerator",
    "Live metrics",
    "The run page under load",
}


def resolves(cited: str) -> bool:
    """A cited path, or a glob of several (``profile-*.json``), names at least one file."""
    return any(REPO.glob(cited)) if "*" in cited else (REPO / cited).is_file()


def readme_bullets() -> dict[str, str]:
    """The README's "What it measures" bullets, by their bold lead."""
    text = README.read_text()
    section = text.split("## What it measures", 1)[1].split("\n## ", 1)[0]
    bullets = {}
    for bullet in re.split(r"\n(?=- )", section):
        lead = re.match(r"- \*\*(.+?)\*\*", bullet)
        if lead:
            bullets[lead.group(1).rstrip(":")] = bullet
    return bullets


def benchmark_sections() -> dict[str, str]:
    """docs/benchmarks.md's sections (## and ###), by heading, each without its subsections."""
    parts = re.split(r"(?m)^#{2,3} (.+)$", BENCHMARKS.read_text())
    return dict(zip(parts[1::2], parts[2::2]))


def with_figures_uncited(texts: dict[str, str]) -> set[str]:
    return {name for name, text in texts.items() if FIGURE.search(text) and not CITATION.search(text)}


def test_every_results_file_the_docs_cite_exists():
    missing = [f"{doc.name}: {cited}" for doc in (README, BENCHMARKS) for cited in CITATION.findall(doc.read_text())
               if not resolves(cited.rstrip("."))]
    assert not missing, "cited results files that do not exist:\n" + "\n".join(missing)


def test_every_readme_figure_cites_a_results_file_but_the_older_ones_listed():
    bullets = readme_bullets()
    assert "Against TRL, at the same threads" in bullets  # the section is read at all
    uncited = with_figures_uncited(bullets)
    assert uncited <= README_WITHOUT_RESULTS, f"README figures without a results file: {uncited - README_WITHOUT_RESULTS}"
    # a figure given a results file leaves the list; one whose bullet is gone too
    assert README_WITHOUT_RESULTS <= uncited, f"listed but cited or gone: {README_WITHOUT_RESULTS - uncited}"


def test_every_benchmarks_section_with_figures_cites_a_results_file_but_the_older_ones_listed():
    sections = benchmark_sections()
    uncited = with_figures_uncited(sections)
    assert uncited <= BENCHMARKS_WITHOUT_RESULTS, \
        f"docs/benchmarks.md sections with figures and no results file: {uncited - BENCHMARKS_WITHOUT_RESULTS}"
    assert BENCHMARKS_WITHOUT_RESULTS <= uncited, f"listed but cited or gone: {BENCHMARKS_WITHOUT_RESULTS - uncited}"


def results_with_meta() -> list[Path]:
    found = []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "meta" in data:
            found.append(path)
    return found


def test_results_files_from_vs_trl_carry_a_meta_block():
    trl = sorted(RESULTS.glob("vs_trl-*.json"))
    assert trl, "bench/vs_trl.py has written no results file"
    assert set(trl) <= set(results_with_meta())


@pytest.mark.parametrize("path", results_with_meta(), ids=lambda p: p.name)
def test_a_results_file_with_meta_says_date_commit_machine_and_command(path):
    meta = json.loads(path.read_text())["meta"]
    date = datetime.date.fromisoformat(meta["date"])
    assert datetime.date(2026, 1, 1) <= date <= datetime.date.today() + datetime.timedelta(days=1)
    assert re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", meta["commit"]), meta["commit"]
    machine = meta["machine"]
    assert isinstance(machine["cpu"], str) and machine["cpu"] and isinstance(machine["cores"], int) and machine["cores"] >= 1
    command = meta["command"].split()
    assert command[0] == ".venv/bin/python" and (REPO / command[1]).is_file(), meta["command"]
    if path.name.startswith("vs_trl-"):  # named by its date
        assert path.name.startswith(f"vs_trl-{meta['date']}")


def matrix_rows() -> list[tuple[str, list[str]]]:
    """docs/benchmarks.md's TRL matrix: (workload, cells) of each row that cites a vs_trl file."""
    section = benchmark_sections()["FluxRL against TRL, at the same threads"]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and any("vs_trl-" in c for c in cells):
            rows.append((cells[0].strip("`"), cells))
    return rows


def test_the_trl_matrix_table_quotes_its_results_files():
    rows = matrix_rows()
    assert rows, "docs/benchmarks.md's TRL section has no row citing bench/results/vs_trl-*.json"
    for workload, cells in rows:
        cited = next(CITATION.search(c).group(0) for c in cells if CITATION.search(c))
        data = json.loads((REPO / cited).read_text())
        row, meta = data["matrix"][workload], data["meta"]
        assert meta["date"] in cells and f"`{meta['commit']}`" in cells, (workload, cells)
        figures = {f"{row['trl']:.1f}", f"{row['sync_x_trl']:.2f}", f"{row['async_x_trl']:.2f}",
                   f"{row['best_x_trl']:.2f}"}
        shown = {re.sub(r"[*×]", "", c).strip() for c in cells}
        if meta.get("load_average", 0) > meta["machine"]["cores"]:
            # measured on an oversubscribed machine: a peer's threads collapse there, so no
            # ratio of that run is shown, and the row says why
            assert not figures & shown and any("not a comparison" in c for c in cells), (workload, cells)
            continue
        assert figures <= shown, (workload, figures - shown)
        assert any(row["best"] in c for c in cells), (workload, row["best"])
