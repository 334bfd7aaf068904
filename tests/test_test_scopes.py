"""tests/conftest.py's scopes for pytest-xdist: which worker may take which file."""
from pathlib import Path

from tests import conftest
from tests.conftest import ENGINE_FILES, FREE_ENGINE_FILES

ROOT = Path(__file__).resolve().parents[1]
TIMERS = ("time.monotonic", "time.perf_counter", "time.time(")


def test_engine_files_run_on_the_engine_chain_and_the_free_ones_on_any_worker():
    assert conftest.test_scope("tests/workers/coord/test_resume.py::test_x", ROOT) == "engine"
    assert all(conftest.test_scope(f"{path}::test_x", ROOT) == "engine" for path in ENGINE_FILES)
    assert [conftest.test_scope(f"{path}::test_x[a]", ROOT) for path in FREE_ENGINE_FILES] == list(FREE_ENGINE_FILES)
    assert conftest.test_scope("tests/platform/runs/test_dispatch.py::test_x", ROOT) == "platform"
    assert conftest.test_scope("tests/workers/train/test_trainer.py::test_x", ROOT) == "trainer"


def test_every_free_engine_file_exists_starts_an_engine_and_times_nothing():
    for path in FREE_ENGINE_FILES:
        text = (ROOT / path).read_text()
        assert "mark.engine" in text, path  # else it needs no exception
        assert not any(timer in text for timer in TIMERS), f"{path} times something: keep it on the engine chain"
