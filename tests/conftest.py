"""Shared fixtures for the whole suite."""
import functools
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_path():
    """The tiny model folder (built once per machine, then cached)."""
    from workers.models.tinymodel import ensure_tiny_model

    return str(ensure_tiny_model(progress=False))


# One rerun for a test that starts real processes (the engine, trainer ranks, a browser).
# They race a shared 2-core machine, and a run of ~25 minutes that fails on one lost race
# loses everything it checked. A rerun is printed ("R", and "rerun" in the summary), so a
# race stays in the log to be found; a test that fails twice fails.
# FLUXRL_TEST_RERUNS=0 turns it off (when hunting a race).
RERUN_MARKERS = ("engine", "distributed", "browser")


def pytest_collection_modifyitems(config, items):
    import os

    reruns = int(os.environ.get("FLUXRL_TEST_RERUNS", "1"))
    if reruns <= 0 or not config.pluginmanager.hasplugin("rerunfailures"):
        return
    for item in items:
        if item.get_closest_marker("flaky") is None and any(item.get_closest_marker(m) for m in RERUN_MARKERS):
            item.add_marker(pytest.mark.flaky(reruns=reruns, reruns_delay=2))


# Where each test runs under pytest-xdist (scripts/test.sh: -n 2). The controller, which does
# not collect, sees node ids only, so a test's scope is found from its path and its file:
# - "platform": tests/platform, tests/browser, the reward sandbox's tests and the top-level
#   ones, all on one worker: two tests never flush or share a Redis database, a channel
#   group or a sandbox uid at the same time;
# - "engine": every other file that marks a test engine or distributed, and the platform's
#   files that train in their own process on their worker's own database (ENGINE_FILES):
#   the CPU-bound runs go one after another on one worker, and timing-bound checks in them
#   never meet another engine run;
# - "trainer": tests/workers/train, the trainer on its own (DeepSpeed in this process or in
#   rank processes, no engine), one file after another on the first worker free, beside the
#   engine runs once the platform's tests are done;
# - any other file is a scope of its own, taken by whichever worker is free, so the two
#   workers end together. Among them are the engine files of FREE_ENGINE_FILES: runs that time
#   nothing, checked by what they train and write, which the free worker takes beside the engine
#   chain (it would otherwise idle for its last minutes).
# (xdist 3.8's xdist_group marks do not reach its scheduler under pytest 9, whose nodeid no
# longer reads Item._nodeid.) The engine's and the platform's scopes are handed out first, one
# to each worker, so the longest chains start at once, then the trainer's; xdist queues the
# rest by size.
PLATFORM_SCOPES = ("tests/platform/", "tests/browser/", "tests/workers/rewards/")
ENGINE_FILES = ("tests/platform/runs/test_model_export.py", "tests/platform/datasets/test_formats_train.py")
ENGINE_MARKS = ("mark.engine", "mark.distributed")
FREE_ENGINE_FILES = ("tests/workers/models/test_model_zoo_engine.py", "tests/workers/coord/test_rlhf_run.py",
                     "tests/workers/cli/test_cli_exporters.py")
TRAINER_SCOPE = "tests/workers/train/"


def test_scope(nodeid: str, root: Path) -> str:
    path = nodeid.split("::", 1)[0]
    if path in ENGINE_FILES:
        return "engine"
    top_level = path.startswith("tests/") and "/" not in path[len("tests/"):]
    if top_level or path.startswith(PLATFORM_SCOPES):
        return "platform"
    if path.startswith(TRAINER_SCOPE):
        return "trainer"
    return "engine" if path not in FREE_ENGINE_FILES and _marks_engine(root / path) else path


@functools.cache
def _marks_engine(path: Path) -> bool:
    try:
        text = path.read_text()
    except OSError:
        return False
    return any(mark in text for mark in ENGINE_MARKS)


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    root = Path(config.rootpath)

    class RoleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return test_scope(nodeid, root)

        def _assign_work_unit(self, node) -> None:
            for scope in ("trainer", "platform", "engine"):  # the engine's ends up first
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return RoleScheduling(config, log)
