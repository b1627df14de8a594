"""The request gate (service.api.gate): the body limit, the token before the body, and dev mode's
Host, Origin and cross-site body checks, with forwarding headers believed only from trusted proxies.

The body tests call the app as uvicorn does, with a `receive` that counts how often the app asked for
the body: "refused before the body is read" is measured, not inferred from the status code."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from tests.fakes import FakeBackend
from tests.support import JOBS, bearer, issue_token, runtime_of

LIMIT = 4096
BODY: dict[str, Any] = {"name": "g", "entrypoint": "worker.tasks.seed:ddp_step"}
HERE = "127.0.0.1:8321"


def message(response: Any) -> str:
    return " ".join(str(item["msg"]) for item in response.json()["detail"])


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: dict[str, Any]
    body_reads: int  # how often the app called receive()


@dataclass
class Gate:
    client: TestClient
    token: str
    sent: list[bytes] = field(default_factory=list)

    def call(self, method: str, path: str, chunks: list[bytes], headers: dict[str, str]) -> Answer:
        """One request through the whole app (middleware included), its body in `chunks`."""
        reads = 0
        pending = list(chunks)

        async def receive() -> dict[str, Any]:
            nonlocal reads
            reads += 1
            if not pending:
                return {"type": "http.disconnect"}
            chunk = pending.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

        messages: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            messages.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(name.lower().encode(), value.encode()) for name, value in headers.items()],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8321),
            "state": {},
        }
        assert self.client.portal is not None
        app: Any = self.client.app
        self.client.portal.call(app, scope, receive, send)
        start = next(m for m in messages if m["type"] == "http.response.start")
        body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
        answer_headers = {name.decode(): value.decode() for name, value in start["headers"]}
        return Answer(start["status"], answer_headers, json.loads(body), reads)

    def jobs_stored(self) -> int:
        response = self.client.get(JOBS, headers=bearer(self.token))
        assert response.status_code == 200, response.text
        return len(response.json()["items"])


@pytest.fixture
def gate(settings: Settings, fake: FakeBackend) -> Iterator[Gate]:
    app = create_app(settings.model_copy(update={"max_body_bytes": LIMIT}), backends={"local": fake})
    with TestClient(app) as client:
        yield Gate(client, issue_token(runtime_of(client).engine, "alice"))


# ---------------------------------------------------------------- the body limit, the token first


def test_a_stranger_is_refused_before_one_byte_of_the_body_is_read(gate: Gate) -> None:
    not_json = b"{" * (LIMIT - 1)
    headers = {"content-type": "application/json", "content-length": str(len(not_json))}
    answer = gate.call("POST", JOBS, [not_json], headers)

    assert answer.status == 401  # not 422: the body was never parsed
    assert answer.body_reads == 0
    assert answer.headers["www-authenticate"] == "Bearer"


def test_a_body_declared_over_the_limit_gets_413_unread_even_with_a_token(gate: Gate) -> None:
    headers = {"authorization": f"Bearer {gate.token}", "content-length": str(10_000_000)}
    answer = gate.call("POST", JOBS, [b"x" * 1024], headers)

    assert answer.status == 413 and answer.body_reads == 0
    assert f"limit of {LIMIT} bytes (TORCHYARD_MAX_BODY_BYTES)" in answer.body["detail"][0]["msg"]
    assert answer.headers["connection"] == "close"  # the client need not send the rest


def test_a_body_that_grows_past_the_limit_unannounced_gets_413_and_stores_nothing(gate: Gate) -> None:
    padded = json.dumps({**BODY, "kwargs": {"pad": "x" * LIMIT}}).encode()
    chunks = [padded[i : i + 1000] for i in range(0, len(padded), 1000)]  # chunked: no length sent
    headers = {"authorization": f"Bearer {gate.token}", "content-type": "application/json"}
    answer = gate.call("POST", JOBS, chunks, headers)

    assert answer.status == 413
    assert answer.body_reads == LIMIT // 1000 + 1  # it stopped at the first chunk over the limit
    assert gate.jobs_stored() == 0


def test_a_body_under_the_limit_is_served(gate: Gate) -> None:
    body = json.dumps(BODY).encode()
    headers = {"authorization": f"Bearer {gate.token}", "content-type": "application/json",
               "content-length": str(len(body))}  # fmt: skip
    answer = gate.call("POST", JOBS, [body], headers)

    assert answer.status == 201, answer.body
    assert gate.jobs_stored() == 1


def test_public_paths_answer_without_a_token_and_nothing_else_does(gate: Gate) -> None:
    client = gate.client
    for path in ("/healthz", "/openapi.json", "/docs", "/"):
        assert client.get(path).status_code == 200, path
    for path in ("/api/v1/jobs", "/metrics", "/api/v1/nothing-here", "/healthz/../api/v1/jobs"):
        assert client.get(path).status_code == 401, path


# ---------------------------------------------------------------- dev mode


@pytest.fixture
def dev(settings: Settings, fake: FakeBackend) -> Iterator[TestClient]:
    app = create_app(settings.model_copy(update={"dev_mode": True}), backends={"local": fake})
    with TestClient(app, base_url=f"http://{HERE}", client=("127.0.0.1", 50000)) as client:
        yield client


@pytest.mark.parametrize("host", ["localhost:8321", HERE, "[::1]:8321", "127.0.0.2"])
def test_dev_mode_answers_to_loopback_names(dev: TestClient, host: str) -> None:
    assert dev.get(JOBS, headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8321", "10.0.0.1:8321", ""])
def test_dev_mode_refuses_any_other_host_name_against_dns_rebinding(dev: TestClient, host: str) -> None:
    response = dev.get(JOBS, headers={"Host": host, "Origin": f"http://{host}"})
    assert response.status_code == 403
    assert "loopback name" in message(response)


@pytest.mark.parametrize(
    "origin", ["http://attacker.example", "http://localhost:9999", "https://127.0.0.1:8321", "null"]
)
def test_dev_mode_refuses_a_page_of_another_site(dev: TestClient, origin: str) -> None:
    response = dev.post(JOBS, json=BODY, headers={"Origin": origin})
    assert response.status_code == 403
    assert "another site" in message(response)
    assert dev.get(JOBS).json()["items"] == []


def test_dev_mode_takes_a_write_from_its_own_page(dev: TestClient) -> None:
    response = dev.post(JOBS, json=BODY, headers={"Origin": f"http://{HERE}"})
    assert response.status_code == 201, response.text


@pytest.mark.parametrize(
    "content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                     "multipart/form-data; boundary=x"]
)  # fmt: skip
def test_dev_mode_refuses_the_bodies_a_cross_site_form_can_send(dev: TestClient, content_type: str) -> None:
    response = dev.post(JOBS, content=json.dumps(BODY), headers={"Content-Type": content_type})
    assert response.status_code == 403
    assert "send application/json" in message(response)
    assert dev.get(JOBS).json()["items"] == []


def test_forwarding_headers_are_ignored_unless_the_peer_is_a_trusted_proxy(
    settings: Settings, fake: FakeBackend
) -> None:
    dev = settings.model_copy(update={"dev_mode": True})
    proxied = dev.model_copy(update={"trusted_proxies": ["127.0.0.1"]})

    def ask(config: Settings, peer: str, forwarded_for: str) -> int:
        app = create_app(config, backends={"local": fake})
        with TestClient(app, base_url=f"http://{HERE}", client=(peer, 50000)) as client:
            status: int = client.get(JOBS, headers={"X-Forwarded-For": forwarded_for}).status_code
            return status

    # No proxy trusted: the peer decides, whatever the header says.
    assert ask(dev, "192.0.2.7", "127.0.0.1") == 403
    assert ask(dev, "127.0.0.1", "203.0.113.9") == 200
    # The proxy on this machine trusted: the client it names decides.
    assert ask(proxied, "127.0.0.1", "203.0.113.9") == 403
    assert ask(proxied, "127.0.0.1", "127.0.0.1") == 200
    assert ask(proxied, "192.0.2.7", "127.0.0.1") == 403  # a stranger is no proxy
