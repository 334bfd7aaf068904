from datetime import timedelta

from django.utils import timezone
from rest_framework.test import APIClient

from fluxrl.accounts.models import ApiToken
from fluxrl.accounts.services import create_api_token, hash_key


def test_created_token_key_is_shown_once_and_only_its_hash_is_stored(api_a, alice):
    created = api_a.post("/api/tokens/", {"name": "ci", "scopes": ["read"]})
    assert created.status_code == 201
    key = created.json()["key"]
    token = ApiToken.objects.get(pk=created.json()["id"])
    assert token.key_hash == hash_key(key) and key not in (token.prefix, token.key_hash)
    listed = api_a.get("/api/tokens/").json()["results"]
    assert {t["name"] for t in listed} == {"test", "ci"}
    assert all("key" not in t for t in listed)


def test_request_without_credentials_is_401_with_json_error(db, assert_error):
    response = APIClient().get("/api/runs/")
    assert_error(response, 401, "not_authenticated")
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_unknown_malformed_revoked_and_expired_keys_are_401(alice, assert_error):
    _, revoked = create_api_token(alice, "old")
    ApiToken.objects.filter(key_hash=hash_key(revoked)).update(revoked_at=timezone.now())
    _, expired = create_api_token(alice, "short", expires_at=timezone.now() - timedelta(seconds=1))
    for header in ["Bearer flxu_nope", "Bearer a b", f"Bearer {revoked}", f"Bearer {expired}"]:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=header)
        assert_error(client.get("/api/teams/"), 401, "authentication_failed")


def test_revoking_a_token_through_the_api_makes_it_fail(api_a, alice, client_for, assert_error):
    other = client_for(alice)
    token_id = ApiToken.objects.filter(user=alice).order_by("-id").first().id
    assert api_a.delete(f"/api/tokens/{token_id}/").status_code == 204
    assert_error(other.get("/api/teams/"), 401)
    assert api_a.get(f"/api/tokens/{token_id}/").json()["active"] is False


def test_read_only_token_cannot_write(client_for, alice, assert_error):
    reader = client_for(alice, scopes=["read"])
    assert reader.get("/api/runs/").status_code == 200
    error = assert_error(reader.post("/api/teams/", {"name": "X", "slug": "x"}), 403, "permission_denied")
    assert "write" in error["message"]


def test_team_bound_token_sees_only_its_team(make_member, team_a, team_b, alice, client_for):
    make_member("alice", team_b)
    bound = client_for(alice, team=team_a)
    assert [t["slug"] for t in bound.get("/api/teams/").json()["results"]] == ["team-a"]
    assert [t["slug"] for t in client_for(alice).get("/api/teams/").json()["results"]] == ["team-a", "team-b"]


def test_token_created_through_a_token_cannot_gain_scopes_or_leave_its_team(client_for, alice, team_a, assert_error):
    reader_writer = client_for(alice, scopes=["write", "read"], team=team_a)
    assert_error(reader_writer.post("/api/tokens/", {"name": "wide"}, format="json"), 403)  # unbound
    narrow = reader_writer.post("/api/tokens/", {"name": "narrow", "scopes": ["read"], "team": "team-a"})
    assert narrow.status_code == 201 and narrow.json()["scopes"] == ["read"]
    writer_only = client_for(alice, scopes=["write"])
    assert_error(writer_only.post("/api/tokens/", {"name": "more", "scopes": ["read", "write"]}), 403)


def test_token_records_when_it_was_last_used(alice):
    token, key = create_api_token(alice, "t")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    client.get("/api/me/")
    token.refresh_from_db()
    assert token.last_used_at is not None


def test_users_cannot_see_or_revoke_each_others_tokens(api_b, alice, assert_error):
    token, _ = create_api_token(alice, "mine")
    assert_error(api_b.delete(f"/api/tokens/{token.id}/"), 404, "not_found")
    token.refresh_from_db()
    assert token.revoked_at is None
