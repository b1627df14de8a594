"""`POST /api/v1/auth/proxy` behind a real nginx (tests.nginx) that signs users in and names them in
X-Forwarded-User: the header is honoured through nginx (a trusted proxy, TORCHYARD_TRUSTED_PROXIES),
and ignored from any other address, the same header sent straight to the service."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.app import create_app
from service.config import Settings
from tests.fakes import FakeBackend
from tests.nginx import PROXY_ADDRESS, USER_HEADER, NginxProxy
from tests.nginx import missing as nginx_missing
from tests.serving import LiveServer, serve
from tests.support import bearer, issue_token, missing_dependency

SIGN_IN = "/api/v1/auth/proxy"
USERS = {"alice": "alice-pw", "bob": "bob-pw", "carol": "carol-pw"}  # carol: no account on this host


@pytest.fixture
def proxied(settings: Settings, fake: FakeBackend, tmp_path: Path) -> Iterator[tuple[LiveServer, NginxProxy]]:
    if problem := nginx_missing():
        missing_dependency(problem)
    settings = settings.model_copy(
        update={
            "trusted_proxies": [f"{PROXY_ADDRESS}/32"],
            "proxy_user_header": USER_HEADER,
            "admin_groups": ["bob"],
        }
    )
    with serve(create_app(settings, backends={"local": fake, "slurm": FakeBackend()})) as server:
        proxy = NginxProxy(tmp_path / "nginx", server.url, USERS)
        try:
            proxy.start()
        except Exception as error:
            proxy.stop()
            missing_dependency(f"nginx could not start: {error}")
        try:
            yield server, proxy
        finally:
            proxy.stop()


def test_the_user_nginx_signed_in_gets_a_token_of_their_account(
    proxied: tuple[LiveServer, NginxProxy],
) -> None:
    server, proxy = proxied
    # What the client says in the header itself does not count: nginx names whom it signed in.
    answer = httpx.post(f"{proxy.url}{SIGN_IN}", auth=("alice", USERS["alice"]), headers={USER_HEADER: "bob"})

    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["user"], body["unix_user"]) == ("alice", "alice")
    me = httpx.get(f"{server.url}/api/v1/whoami", headers=bearer(body["token"]))
    assert me.json() == {"user": "alice", "admin": False}
    tokens = httpx.get(f"{server.url}/api/v1/tokens", headers=bearer(body["token"])).json()
    assert [token["via"] for token in tokens] == ["proxy"]
    admin = httpx.post(f"{proxy.url}{SIGN_IN}", auth=("bob", USERS["bob"]))
    assert admin.status_code == 200, admin.text
    assert httpx.get(f"{server.url}/api/v1/whoami", headers=bearer(admin.json()["token"])).json()["admin"]


def test_the_header_sent_straight_to_the_service_is_ignored(proxied: tuple[LiveServer, NginxProxy]) -> None:
    server, proxy = proxied
    direct = httpx.post(f"{server.url}{SIGN_IN}", headers={USER_HEADER: "alice"})

    assert direct.status_code == 401, direct.text
    assert "no trusted proxy signed you in" in direct.text
    unsigned = httpx.post(f"{proxy.url}{SIGN_IN}", headers={USER_HEADER: "alice"})
    assert unsigned.status_code == 401  # nginx's own: no password, no request reaches the service
    engine = server.runtime.engine
    audit = httpx.get(f"{server.url}/api/v1/audit", headers=bearer(issue_token(engine, "root", admin=True)))
    assert "login" not in {entry["action"] for entry in audit.json()}


def test_a_proxied_user_without_an_account_here_is_refused(proxied: tuple[LiveServer, NginxProxy]) -> None:
    server, proxy = proxied
    answer = httpx.post(f"{proxy.url}{SIGN_IN}", auth=("carol", USERS["carol"]))

    assert answer.status_code == 403, answer.text
    assert "'carol' has no account" in answer.text
    engine = server.runtime.engine
    audit = httpx.get(
        f"{server.url}/api/v1/audit", headers=bearer(issue_token(engine, "root", admin=True))
    ).json()
    (refusal,) = [entry for entry in audit if entry["action"] == "login.refused"]
    assert (refusal["actor"], refusal["target"]) == ("carol", "proxy")
    assert "source=127.0.0.1" in refusal["detail"]
