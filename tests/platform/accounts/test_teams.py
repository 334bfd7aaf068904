from django.core.management import call_command

from fluxrl.accounts.models import ApiToken, Membership, Organisation, Team
from fluxrl.accounts.services import authenticate_key


def test_me_lists_my_teams_with_my_role(api_bob):
    body = api_bob.get("/api/me/").json()
    assert body == {"username": "bob", "teams": [body["teams"][0]], "sandbox": body["sandbox"]}  # sandbox: test_sandbox_state.py
    assert body["teams"][0]["slug"] == "team-a" and body["teams"][0]["role"] == "member"


def test_creating_a_team_makes_the_creator_its_admin(api_bob, bob, settings, assert_error):
    settings.FLUXRL_TEAM_CREATION = "anyone"
    response = api_bob.post("/api/teams/", {"name": "Research", "slug": "research"})
    assert response.status_code == 201 and response.json()["role"] == "admin"
    assert Membership.objects.get(team__slug="research").user == bob
    assert_error(api_bob.post("/api/teams/", {"name": "Again", "slug": "research"}), 409, "conflict")


def test_only_staff_create_teams_by_default(api_bob, bob, client_for, assert_error):
    error = assert_error(api_bob.post("/api/teams/", {"name": "Mine", "slug": "mine"}), 403, "permission_denied")
    assert "Only platform staff may create teams" in error["message"] and "FLUXRL_TEAM_CREATION" in error["message"]
    assert not Team.objects.filter(slug="mine").exists()
    bob.is_staff = True
    bob.save()
    assert client_for(bob).post("/api/teams/", {"name": "Mine", "slug": "mine"}).status_code == 201


def test_a_teams_organisation_is_not_set_through_the_api(api_bob, bob, settings):
    settings.FLUXRL_TEAM_CREATION = "anyone"
    acme = Organisation.objects.create(name="Acme", slug="acme")
    response = api_bob.post("/api/teams/", {"name": "In", "slug": "in", "organisation": acme.pk}, format="json")
    assert response.status_code == 201 and Team.objects.get(slug="in").organisation is None


def test_admin_adds_and_removes_members(api_a, carol):
    added = api_a.post("/api/teams/team-a/members/", {"username": "carol", "role": "member"})
    assert added.status_code == 201
    members = api_a.get("/api/teams/team-a/members/").json()["results"]
    assert {m["username"] for m in members} == {"alice", "carol"}
    assert api_a.delete("/api/teams/team-a/members/carol/").status_code == 204
    assert not Membership.objects.filter(user=carol, team__slug="team-a").exists()


def test_non_admin_member_cannot_manage_members(api_bob, alice, carol, assert_error):
    assert_error(api_bob.post("/api/teams/team-a/members/", {"username": "carol"}), 403, "permission_denied")
    assert_error(api_bob.delete("/api/teams/team-a/members/alice/"), 403)


def test_other_teams_and_their_members_are_404(api_a, team_b, carol, assert_error):
    assert_error(api_a.get("/api/teams/team-b/"), 404, "not_found")
    assert_error(api_a.get("/api/teams/team-b/members/"), 404)
    assert_error(api_a.post("/api/teams/team-b/members/", {"username": "alice"}), 404)


def test_last_admin_cannot_be_removed(api_a, bob, assert_error):
    assert_error(api_a.delete("/api/teams/team-a/members/alice/"), 409, "conflict")
    assert api_a.delete("/api/teams/team-a/members/bob/").status_code == 204


def test_adding_an_unknown_user_or_a_member_twice_fails(api_a, bob, assert_error):
    assert_error(api_a.post("/api/teams/team-a/members/", {"username": "nobody"}), 404, field="username")
    assert_error(api_a.post("/api/teams/team-a/members/", {"username": "bob"}), 409)


def test_bootstrap_demo_is_idempotent_and_prints_a_working_key(db, capsys):
    call_command("bootstrap_demo")
    first = capsys.readouterr().out.strip()
    call_command("bootstrap_demo")
    second = capsys.readouterr().out.strip()
    assert authenticate_key(first) is None  # replaced
    user, _ = authenticate_key(second)
    assert user.username == "demo" and Membership.objects.filter(user=user, team__slug="demo", role="admin").count() == 1
    assert ApiToken.objects.filter(user=user, revoked_at__isnull=True).count() == 1


def test_bootstrap_demo_with_fixed_key_keeps_it(db, capsys):
    key = "flxu_" + "k" * 40
    call_command("bootstrap_demo", key=key)
    call_command("bootstrap_demo", key=key)
    assert capsys.readouterr().out.split() == [key, key]
    assert authenticate_key(key)[0].username == "demo"
