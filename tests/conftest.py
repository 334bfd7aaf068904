"""Shared fixtures for the whole suite."""
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


# Where each test runs under pytest-xdist (scripts/test.sh: -n 2). Two scopes, one per
# worker: "platform" (tests/platform, tests/browser, the reward sandbox's tests and the
# top-level ones) and "workers" (the engine's and the benches'). So the CPU-bound engine
# runs go one after another on one worker, and everything that touches the shared
# PostgreSQL/Redis servers or the sandbox's uid pool runs on the other: two tests never
# flush or share a Redis database, a channel group or a sandbox uid at the same time.
# (By path, in the controller, which does not collect: xdist 3.8's xdist_group marks do
# not reach its scheduler under pytest 9, whose nodeid no longer reads Item._nodeid.)
PLATFORM_SCOPES = ("tests/platform/", "tests/browser/", "tests/workers/rewards/")


def test_scope(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    top_level = path.startswith("tests/") and "/" not in path[len("tests/"):]
    return "platform" if top_level or path.startswith(PLATFORM_SCOPES) else "workers"


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class RoleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return test_scope(nodeid)

    return RoleScheduling(config, log)
