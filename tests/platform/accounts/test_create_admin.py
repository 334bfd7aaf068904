"""manage.py create_admin: the first admin of a deployment, with no default password."""
import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command

from fluxrl.accounts.models import Membership, Role

pytestmark = pytest.mark.django_db


def test_create_admin_makes_a_superuser_admin_of_the_team_with_the_password_from_the_environment(monkeypatch):
    monkeypatch.setenv("FLUXRL_ADMIN_PASSWORD", "correct horse battery staple 7")
    call_command("create_admin", "--username", "alice", "--team", "acme")
    user = get_user_model().objects.get(username="alice")
    assert user.is_superuser and user.is_staff and user.check_password("correct horse battery staple 7")
    assert Membership.objects.get(user=user).role == Role.ADMIN
    assert Membership.objects.get(user=user).team.slug == "acme"


def test_create_admin_refuses_a_weak_password_and_no_password_without_a_terminal(monkeypatch):
    monkeypatch.setenv("FLUXRL_ADMIN_PASSWORD", "demo")
    with pytest.raises(CommandError, match="password refused"):
        call_command("create_admin", "--username", "demo", "--team", "demo")
    monkeypatch.delenv("FLUXRL_ADMIN_PASSWORD")
    with pytest.raises(CommandError, match="FLUXRL_ADMIN_PASSWORD"):
        call_command("create_admin", "--username", "demo", "--team", "demo")
    assert not get_user_model().objects.filter(username="demo").exists()


def test_create_admin_refuses_an_existing_user(monkeypatch):
    get_user_model().objects.create_user(username="alice", password="x")
    monkeypatch.setenv("FLUXRL_ADMIN_PASSWORD", "correct horse battery staple 7")
    with pytest.raises(CommandError, match="exists already"):
        call_command("create_admin", "--username", "alice", "--team", "acme")
    assert get_user_model().objects.get(username="alice").check_password("x")
