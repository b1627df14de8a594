"""The request gate looks a token up once however many of its requests arrive while it is unchecked."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import select
from starlette.types import Message, Receive, Scope, Send

from service.api.gate import PRINCIPAL, RequestGate
from service.config import Settings
from service.domain import auth
from service.domain.auth import Principal, TokenCheck
from service.ledger.db import session_scope
from service.ledger.models.access import ApiToken
from tests.support import run_async

CALLERS = 30


class CountingCheck(TokenCheck):
    """A real check on a real ledger whose lookups are counted and slow enough to overlap."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.lookups = 0
        self._count_lock = threading.Lock()

    def lookup(self, raw: str) -> Principal:
        with self._count_lock:
            self.lookups += 1
        time.sleep(0.05)
        return super().lookup(raw)


@pytest.fixture
def check(engine: Engine) -> CountingCheck:
    with session_scope(engine) as session:
        auth.create_token(session, "alice")  # a ledger with tokens: an unknown one is "not valid"
    return CountingCheck(engine, 0.0)  # nothing stays cached: every request that comes alone looks up


def token_in(check: CountingCheck) -> str:
    with session_scope(check._engine) as session:
        return auth.create_token(session, "bob")


def request_for(check: CountingCheck, token: str) -> Scope:
    app = SimpleNamespace(state=SimpleNamespace(runtime=SimpleNamespace(tokens=check)))
    return {
        "type": "http",
        "method": "GET",
        "path": "/api/v1/jobs",
        "headers": [(b"authorization", f"Bearer {token}".encode())],
        "app": app,
    }


async def through_gate(gate: RequestGate, scope: Scope) -> tuple[Principal | None, int]:
    """(the principal the gate left for the route, the status it answered: 200 from the route)."""
    answered: list[int] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b""}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            answered.append(message["status"])

    await gate(scope, receive, send)
    return scope.get(PRINCIPAL), scope.get(ROUTE_ANSWERED) or answered[0]


ROUTE_ANSWERED = "test.route_answered"


async def route(scope: Scope, receive: Receive, send: Send) -> None:
    scope[ROUTE_ANSWERED] = 200


def gate_for(tmp_path: Path) -> RequestGate:
    return RequestGate(route, Settings(data_dir=tmp_path, dev_mode=False))


def test_requests_waiting_for_one_token_share_one_lookup(check: CountingCheck, tmp_path: Path) -> None:
    token, gate = token_in(check), gate_for(tmp_path)

    async def scenario() -> list[tuple[Principal | None, int]]:
        return await asyncio.gather(*(through_gate(gate, request_for(check, token)) for _ in range(CALLERS)))

    answers = run_async(scenario())

    assert check.lookups == 1
    assert {(principal.user if principal else None, status) for principal, status in answers} == {
        ("bob", 200)
    }
    assert gate._lookups == {}  # nothing kept once the lookup is done

    run_async(scenario())  # the cached answer has run out (ttl 0): the next wave looks it up again
    assert check.lookups == 2


def test_an_unknown_token_is_refused_to_every_waiting_request(check: CountingCheck, tmp_path: Path) -> None:
    gate = gate_for(tmp_path)

    async def scenario() -> list[tuple[Principal | None, int]]:
        return await asyncio.gather(
            *(through_gate(gate, request_for(check, "made-up")) for _ in range(CALLERS))
        )

    answers = run_async(scenario())

    assert check.lookups == 1
    assert {status for _, status in answers} == {401}
    assert all(principal is None for principal, _ in answers)


def test_a_caller_that_hangs_up_does_not_cancel_the_lookup_of_the_others(
    check: CountingCheck, tmp_path: Path
) -> None:
    token, gate = token_in(check), gate_for(tmp_path)

    async def scenario() -> tuple[Principal | None, int]:
        first = asyncio.ensure_future(through_gate(gate, request_for(check, token)))
        second = asyncio.ensure_future(through_gate(gate, request_for(check, token)))
        await asyncio.sleep(0.01)  # both wait on the one lookup
        first.cancel()
        return await second

    principal, status = run_async(scenario())

    assert (principal and principal.user, status) == ("bob", 200)
    assert check.lookups == 1


def test_a_token_past_half_its_cached_life_is_looked_up_again_while_requests_go_on(
    engine: Engine, tmp_path: Path
) -> None:
    """Refresh ahead: under steady use no request waits for a lookup; a revoked token is still
    refused within the cache's life."""
    ttl_s = 0.6
    check = CountingCheck(engine, ttl_s)
    token, gate = token_in(check), gate_for(tmp_path)

    async def scenario() -> list[tuple[Principal | None, int]]:
        answers = [await through_gate(gate, request_for(check, token))]  # looked up, and waited on
        assert check.lookups == 1 and gate._lookups == {}
        await asyncio.sleep(ttl_s / 2 + 0.05)  # past half the answer's life
        answers += await asyncio.gather(*(through_gate(gate, request_for(check, token)) for _ in range(5)))
        assert check.lookups == 1 and list(gate._lookups) == [token]  # answered; one lookup in flight
        await gate._lookups[token]
        with session_scope(engine) as session:
            row = session.exec(select(ApiToken).where(ApiToken.token_hash == auth.hash_token(token))).one()
            assert row.id is not None
            auth.revoke_token(session, row.id)
        await asyncio.sleep(ttl_s + 0.05)  # the refreshed answer, made before the revocation, ran out
        answers.append(await through_gate(gate, request_for(check, token)))
        return answers

    answers = run_async(scenario())

    assert [status for _, status in answers] == [200] * 6 + [401]
    assert check.lookups == 3
