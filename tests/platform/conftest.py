"""Fixtures for the platform tests: two teams with their people and API clients, a
dataset, a run and its worker's client. Real database (SQLite or PostgreSQL), no mocks."""
import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from fluxrl.accounts import services as accounts
from fluxrl.accounts.models import Membership, Role, Team
from fluxrl.datasets.services import generate_version
from fluxrl.runs.services import submit_run


@pytest.fixture(autouse=True, scope="session")
def celery_broker_in_this_process():
    """Runs submitted in committed transactions are enqueued for real, but to a broker
    inside the test process: never to Redis or var/broker, where a worker would run them."""
    from fluxrl.celery import app

    app.conf.broker_url = "memory://localhost/"
    return app


@pytest.fixture(autouse=True)
def data_dir(settings, tmp_path):
    settings.FLUXRL_DATA_DIR = tmp_path / "data"
    return settings.FLUXRL_DATA_DIR


@pytest.fixture
def reaper_in_contact(monkeypatch):
    """This process has reached the database for longer than any stale window, as a
    long-lived worker has: its reaper judges heartbeats at once (runs/dispatch.py)."""
    from fluxrl.runs import dispatch

    contact = dispatch.DatabaseContact()
    contact.assume_contact_for(1e6)
    monkeypatch.setattr(dispatch, "db_contact", contact)
    return contact


def bearer(key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


@pytest.fixture
def make_member(db):
    def make(username: str, team: Team, role: str = Role.MEMBER):
        user, _ = get_user_model().objects.get_or_create(username=username)
        Membership.objects.create(user=user, team=team, role=role)
        return user

    return make


@pytest.fixture
def client_for(db):
    """An API client authenticated with a fresh API token of the user (kwargs go to the token)."""

    def make(user, **token_options) -> APIClient:
        return bearer(accounts.create_api_token(user, "test", **token_options)[1])

    return make


@pytest.fixture
def team_a(db):
    return Team.objects.create(name="Team A", slug="team-a")


@pytest.fixture
def team_b(db):
    return Team.objects.create(name="Team B", slug="team-b")


@pytest.fixture
def alice(make_member, team_a):
    return make_member("alice", team_a, Role.ADMIN)


@pytest.fixture
def bob(make_member, team_a):
    return make_member("bob", team_a)


@pytest.fixture
def carol(make_member, team_b):
    return make_member("carol", team_b, Role.ADMIN)


@pytest.fixture
def api_a(client_for, alice):
    return client_for(alice)


@pytest.fixture
def api_bob(client_for, bob):
    return client_for(bob)


@pytest.fixture
def api_b(client_for, carol):
    return client_for(carol)


@pytest.fixture
def dataset_a(team_a, alice):
    return generate_version(team_a, alice, "add", "add", n=30, seed=1)


def make_spec(**sections) -> dict:
    spec = {"name": "add-async", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
            "reward": {"function": "numeric_match"}}
    spec.update(sections)
    return spec


@pytest.fixture
def spec():
    return make_spec


@pytest.fixture
def run_a(team_a, alice, dataset_a):
    return submit_run(team_a, alice, make_spec(task={"dataset": "add@1"}), tags=["baseline"])


@pytest.fixture
def run_b(team_b, carol):
    return submit_run(team_b, carol, make_spec(name="b-run"))


@pytest.fixture
def worker_client():
    """The client a worker of the given run would use (a fresh run token)."""

    def make(run) -> APIClient:
        return bearer(accounts.create_run_token(run)[1])

    return make


@pytest.fixture
def assert_error():
    """Check the API's one error shape and return its body."""

    def check(response, status: int, code: str | None = None, field: str | None = None) -> dict:
        assert response.status_code == status, response.content
        error = response.json()["error"]
        assert set(error) == {"code", "message", "fields"} and error["message"]
        if code:
            assert error["code"] == code
        if field:
            assert field in error["fields"], error
        return error

    return check
