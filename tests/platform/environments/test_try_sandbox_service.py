"""Environment try-it through the sandbox service (FLUXRL_TRY_QUEUE): the worker of
fluxrl.rewards.sandbox_app runs the episode, in a process that is not the web process."""
import logging
import os

import pytest

from tests.platform.rewards.test_try_sandbox_service import (  # noqa: F401 - fixtures
    broker,
    parent_pid,
    redis_url,
    sandbox_worker,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.django_db]

COUNTER = ("class Environment:\n    def reset(self, row):\n        self.turns = 0\n\n"
           "    def step(self, text, token_ids):\n        self.turns += 1\n        return ('again', 0.0, self.turns >= 2)\n")


def test_an_environment_is_tried_by_the_sandbox_workers_process_not_the_web_process(request, api_a, caplog):
    worker = request.getfixturevalue("sandbox_worker")
    caplog.set_level(logging.INFO, logger="fluxrl.environments.services")
    response = api_a.post("/api/environments/try/", {"code": COUNTER, "turns": ["a", "b", "c"], "timeout_s": 2.0},
                          format="json")
    assert response.status_code == 200, response.content
    assert [s["done"] for s in response.json()["steps"]] == [False, True]
    assert "tried_by" not in response.json()
    [record] = [r for r in caplog.records if "run by" in r.getMessage()]
    pid = int(record.args[2])
    assert pid != os.getpid() and (pid == worker.pid or parent_pid(pid) == worker.pid)
