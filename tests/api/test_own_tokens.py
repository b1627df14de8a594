"""GET /api/v1/tokens and POST /api/v1/tokens/{id}/revoke: each user lists and revokes their own
tokens (an admin: everyone's), never seeing a secret; another's token is not found."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.conftest import Login
from tests.support import runtime_of

TOKENS = "/api/v1/tokens"


def test_a_user_lists_only_their_own_tokens_and_an_admin_everyones(api: TestClient, login: Login) -> None:
    bob = login("bob")
    admin = login("root", admin=True)

    alices = api.get(TOKENS).json()
    bobs = api.get(TOKENS, headers=bob).json()
    everyone = api.get(TOKENS, headers=admin).json()

    assert [row["username"] for row in alices] == ["alice"]
    assert [row["username"] for row in bobs] == ["bob"]
    assert {row["username"] for row in everyone} == {"alice", "bob", "root"}
    assert not {"token", "token_hash"} & set(alices[0])  # never the secret, nor its hash
    assert alices[0]["prefix"].startswith("ty_") and alices[0]["expires_at"] is None


def test_a_user_revokes_their_own_token_but_not_anothers(api: TestClient, login: Login) -> None:
    bob = login("bob")
    (alices,) = api.get(TOKENS).json()
    (bobs,) = api.get(TOKENS, headers=bob).json()

    refused = api.post(f"{TOKENS}/{alices['id']}/revoke", headers=bob)
    revoked = api.post(f"{TOKENS}/{bobs['id']}/revoke", headers=bob)
    again = api.post(f"{TOKENS}/{bobs['id']}/revoke", headers=bob)  # idempotent
    runtime_of(api).tokens._known.clear()  # what the token cache held a moment ago
    after = api.get("/api/v1/whoami", headers=bob)

    assert refused.status_code == 404 and "not found" in refused.text
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None, revoked.text
    assert again.status_code == 200 and again.json()["revoked_at"] == revoked.json()["revoked_at"]
    assert after.status_code == 401
    assert api.get("/api/v1/whoami").status_code == 200  # alice's token is untouched
    everyone = api.get(TOKENS, headers=login("root", admin=True), params={"all": "true"}).json()
    assert any(row["username"] == "bob" and row["revoked_at"] for row in everyone)
    audit = api.get("/api/v1/audit", headers=login("root", admin=True)).json()
    assert any(entry["action"] == "token.revoke" and entry["actor"] == "bob" for entry in audit)


def test_revoking_a_token_id_out_of_range_is_a_422_naming_it(api: TestClient) -> None:
    answer = api.post(f"{TOKENS}/0/revoke")

    assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == ["path", "token_id"]
