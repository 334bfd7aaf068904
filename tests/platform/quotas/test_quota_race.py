"""Quota checks under concurrency (PostgreSQL): a check and the row it allows are one
transaction holding the team's row, so racing requests cannot both take the last slot."""
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from django.contrib.auth import get_user_model
from django.db import connection, transaction

from fluxrl.accounts.models import Membership, Role, Team
from fluxrl.accounts.services import create_api_token
from fluxrl.errors import DomainError
from fluxrl.quotas.models import TeamQuota, UserQuota
from fluxrl.quotas.services import check_run_quota
from fluxrl.runs.models import Run
from fluxrl.runs.services import submit_run
from tests.platform.conftest import make_spec
from tests.platform.servers import (
    free_port, needs_postgres, server_env, show_logs, start_daphne, stop, wait_for_server_sessions_to_end,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.django_db(transaction=True), needs_postgres]


@pytest.fixture
def team_with_one_slot():
    user = get_user_model().objects.create(username="racer")
    team = Team.objects.create(name="Race", slug="race")
    Membership.objects.create(user=user, team=team, role=Role.ADMIN)
    TeamQuota.objects.create(team=team, max_runs=1)
    return team, user


def test_a_submit_waits_for_a_concurrent_one_holding_the_last_slot_and_is_then_refused(team_with_one_slot):
    team, user = team_with_one_slot
    checked, release, outcome = threading.Event(), threading.Event(), {}

    def first():  # takes the last slot, and holds its transaction open until told
        try:
            with transaction.atomic():
                check_run_quota(team, {})
                Run.objects.create(team=team, owner=user, name="first", spec={}, resolved_spec={})
                checked.set()
                release.wait(30)
        finally:
            connection.close()

    def second():
        try:
            outcome["run"] = submit_run(team, user, make_spec(name="second"))
        except DomainError as exc:
            outcome["error"] = exc
        finally:
            connection.close()

    holder = threading.Thread(target=first)
    holder.start()
    try:
        assert checked.wait(30)
        racer = threading.Thread(target=second)
        racer.start()
        racer.join(1.5)
        assert racer.is_alive() and not outcome, outcome  # blocked on the team's row, not counted past it
    finally:
        release.set()
        holder.join(30)
    racer.join(30)
    assert "run" not in outcome and outcome["error"].status == 403
    assert "1 of 1 concurrent runs in use" in outcome["error"].message
    assert list(Run.objects.values_list("name", flat=True)) == ["first"]


def test_a_submit_in_another_team_waits_for_the_persons_last_slot_and_is_then_refused(team_with_one_slot):
    """The person's row is locked as the team's is: two of their teams cannot both take
    their last slot."""
    team, user = team_with_one_slot
    TeamQuota.objects.filter(team=team).delete()
    UserQuota.objects.create(user=user, max_runs=1)
    other = Team.objects.create(name="Other", slug="other")
    Membership.objects.create(user=user, team=other, role=Role.ADMIN)
    checked, release, outcome = threading.Event(), threading.Event(), {}

    def first():
        try:
            with transaction.atomic():
                check_run_quota(team, {}, user)
                Run.objects.create(team=team, owner=user, name="first", spec={}, resolved_spec={})
                checked.set()
                release.wait(30)
        finally:
            connection.close()

    def second():
        try:
            outcome["run"] = submit_run(other, user, make_spec(name="second"))
        except DomainError as exc:
            outcome["error"] = exc
        finally:
            connection.close()

    holder = threading.Thread(target=first)
    holder.start()
    try:
        assert checked.wait(30)
        racer = threading.Thread(target=second)
        racer.start()
        racer.join(1.0)
        assert racer.is_alive() and not outcome, outcome  # blocked on the person's row
    finally:
        release.set()
        holder.join(30)
    racer.join(30)
    assert "run" not in outcome and outcome["error"].status == 403
    assert "person quota" in outcome["error"].message and "1 of 1 concurrent runs in use" in outcome["error"].message
    assert list(Run.objects.values_list("name", flat=True)) == ["first"]


def test_concurrent_submits_to_a_live_server_for_the_last_slot_give_exactly_one_run(team_with_one_slot,
                                                                                   django_db_blocker, tmp_path):
    team, user = team_with_one_slot
    key = create_api_token(user, "race")[1]
    port, log = free_port(), tmp_path / "daphne.log"
    web = start_daphne(server_env(tmp_path / "data", port), port, log)
    try:
        url, barrier = f"http://127.0.0.1:{port}/api/runs/", threading.Barrier(6)

        def submit(i):
            session = requests.Session()
            session.headers["Authorization"] = f"Bearer {key}"
            session.get(f"http://127.0.0.1:{port}/api/me/", timeout=30)  # connected before the race
            barrier.wait(30)
            return session.post(url, json={"spec": make_spec(name=f"race-{i}")}, timeout=60)

        with ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(submit, range(6)))
    finally:
        stop(web)
        show_logs(log)
        wait_for_server_sessions_to_end(django_db_blocker)
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [201] + [403] * 5, [r.text for r in responses]
    assert all("1 of 1 concurrent runs in use" in r.json()["error"]["message"] for r in responses if r.status_code == 403)
    assert Run.objects.filter(team=team).count() == 1
