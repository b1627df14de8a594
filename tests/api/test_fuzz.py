"""The API fuzzed against its own OpenAPI schema (schemathesis): no 5xx, every answer as declared.

The schema is the one the service serves (app.openapi()); the requests go through one TestClient
entered once, so the lifespan (migrations, intake, dispatch and reconcile loops) is the real one and
fake backends stand in for local/SLURM. Cases carry a real token: an ordinary user's for every
operation, an admin's for the audit log and the job reads (admins see everyone's jobs); one pass
sends whatever the generator makes of the Authorization header (401s).

Passes per operation:
- coverage: schemathesis's deterministic boundary cases (limits, wrong types, missing and unexpected
  parameters, unexpected methods), positive and negative;
- positive / negative fuzzing (Hypothesis, derandomized, no example database: the same cases on
  every run, in CI too);
- job-id operations once more on ids that exist (the generator alone almost never hits one), and
  POST with a target the allow-list admits, so the accepted path is fuzzed, not only its 422s.
Checks: no 5xx, status code / content type / headers / body as declared, and (coverage cases)
inputs the schema forbids refused.
The figures (cases per pass, status codes seen) are printed and the total is asserted.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from service.app import create_app
from service.config import Settings
from tests.fakes import FakeBackend
from tests.support import bearer, issue_token, submit, wait_for

pytestmark = pytest.mark.timeout(300)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
# Refused inputs the schema forbids: on the coverage cases only. They come from the schema alone
# (wrong types, out-of-range values); random negative cases also hit pydantic's lax parsing, which
# takes "3\f" as 3 everywhere, and would fail on whichever draw happens to find it.
COVERAGE_CHECKS = [*CHECKS, negative_data_rejection]
JOBS = "/api/v1/jobs"
JOB_ID_OPERATIONS = [
    (f"{JOBS}/{{job_id}}", "GET"),
    (f"{JOBS}/{{job_id}}/events", "GET"),
    (f"{JOBS}/{{job_id}}/metrics", "GET"),
    (f"{JOBS}/{{job_id}}/logs", "GET"),
    (f"{JOBS}/{{job_id}}/cancel", "POST"),
]
OPERATIONS = [
    (JOBS, "POST"),
    (JOBS, "GET"),
    *JOB_ID_OPERATIONS,
    ("/api/v1/whoami", "GET"),
    ("/api/v1/audit", "GET"),
    ("/metrics", "GET"),
    ("/healthz", "GET"),
]
# The token is their only input, and every case carries a valid one: nothing to negate.
NO_NEGATIVE = {"/api/v1/whoami", "/metrics", "/healthz"}
ALLOWED_TARGET = "worker.tasks.seed:ddp_step"
MIN_CASES = 2000  # on SQLite; the PostgreSQL run fuzzes a quarter as many (coverage stays whole)
BOTH_MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]


@dataclass
class Tally:
    """What was sent, per operation and pass, and what came back."""

    cases: Counter[str] = field(default_factory=Counter)
    statuses: dict[str, Counter[int]] = field(default_factory=dict)

    def add(self, label: str, status: int) -> None:
        self.cases[label] += 1
        self.statuses.setdefault(label, Counter())[status] += 1

    @property
    def total(self) -> int:
        return sum(self.cases.values())

    def all_statuses(self) -> Counter[int]:
        out: Counter[int] = Counter()
        for counts in self.statuses.values():
            out.update(counts)
        return out

    def report(self) -> str:
        width = max(map(len, self.cases), default=0)
        lines = [
            f"{label:<{width}}  {count:5d}  {dict(sorted(self.statuses[label].items()))}"
            for label, count in sorted(self.cases.items())
        ]
        return "\n".join([*lines, f"{'total':<{width}}  {self.total:5d}"])


def send(client: TestClient, case: Case[Any]) -> httpx.Response:
    """The case as schemathesis serialises it, sent through our TestClient."""
    kwargs = case.as_transport_kwargs(base_url=str(client.base_url))
    assert not kwargs.get("cookies"), "the schema declares no cookies"
    body = kwargs.get("data")
    # Latin-1 header values are valid HTTP (requests sends them); httpx takes them only as bytes.
    headers = {name: value.encode("latin-1") for name, value in kwargs["headers"].items()}
    response: httpx.Response = client.request(
        kwargs["method"],
        kwargs["url"],
        headers=headers,
        params=kwargs.get("params") or None,
        content=body.encode() if isinstance(body, str) else body,
        json=kwargs.get("json"),
    )
    return response


@dataclass
class Fuzzer:
    client: TestClient
    schema: Any
    scale: float
    tally: Tally = field(default_factory=Tally)

    def _check(self, label: str, case: Case[Any], checks: list[Any] = CHECKS) -> None:
        response = send(self.client, case)
        self.tally.add(label, response.status_code)
        case.validate_response(response, checks=checks)

    def _timed(self, label: str, run: Callable[[], None]) -> None:
        started = time.monotonic()
        run()
        print(f"{label}: {self.tally.cases[label]} cases in {time.monotonic() - started:.1f} s")

    def cover(
        self,
        path: str,
        method: str,
        token: str,
        modes: list[GenerationMode] = BOTH_MODES,
        tweak: Callable[[Case[Any], Any], None] | None = None,
        tag: str = "",
    ) -> None:
        """schemathesis's coverage phase: every boundary and wrong-type case it derives, once."""
        operation = self.schema[path][method]
        label = f"{method} {path} coverage{tag}"
        config = self.schema.config.generation_for(operation=operation, phase="coverage")

        def run() -> None:
            for case in self.schema.iter_coverage_cases(
                operation, generation_modes=modes, generation_config=config
            ):
                case.headers = {**(case.headers or {}), "authorization": f"Bearer {token}"}
                if tweak is not None:
                    tweak(case, None)
                self._check(label, case, COVERAGE_CHECKS)

        self._timed(label, run)

    def fuzz(
        self,
        path: str,
        method: str,
        mode: GenerationMode,
        examples: int,
        token: str | None,
        tweak: Callable[[Case[Any], Any], None] | None = None,
        extra: st.SearchStrategy[Any] = st.none(),
        tag: str = "",
    ) -> None:
        """`examples` Hypothesis cases (fewer if the space runs out); token None: generated headers."""
        operation = self.schema[path][method]
        label = f"{method} {path} {mode.value}{tag}"
        fixed = None if token is None else {"authorization": f"Bearer {token}"}
        strategy = operation.as_strategy(mode, headers=fixed)

        @hypothesis_settings(
            max_examples=max(1, round(examples * self.scale)),
            derandomize=True,
            database=None,
            deadline=None,
            phases=[Phase.explicit, Phase.generate, Phase.shrink],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy, value=extra)
        def run(case: Case[Any], value: Any) -> None:
            if tweak is not None:
                tweak(case, value)
            self._check(label, case)

        self._timed(label, run)


def keep_allowed_target(case: Case[Any], _: Any) -> None:
    """An entrypoint the allow-list admits and no script; the rest of the body stays as generated."""
    if isinstance(case.body, dict):
        case.body.pop("script", None)
        case.body["entrypoint"] = ALLOWED_TARGET


def use_job_id(case: Case[Any], job_id: Any) -> None:
    case.path_parameters = {**(case.path_parameters or {}), "job_id": job_id}


@dataclass
class Service:
    client: TestClient
    fake: FakeBackend


@pytest.fixture
def service(settings: Settings) -> Iterator[Service]:
    # Quotas high enough that a thousand POSTs reach the code behind them, not a 429 on every one
    # (tests/api/test_quotas.py covers the limits).
    roomy = settings.model_copy(
        update={"max_active_jobs_per_user": 100_000, "max_submissions_per_minute": 100_000}
    )
    fake = FakeBackend("local")
    app = create_app(roomy, backends={"local": fake, "slurm": FakeBackend("slurm")})
    with TestClient(app) as client:
        yield Service(client, fake)


def seed_jobs(service: Service, alice: str, bob: str) -> list[int]:
    """Jobs of alice (one with logs, one finished, one cancelled) and one of bob's, hidden from her."""
    client, fake = service.client, service.fake
    client.headers.update(bearer(alice))
    ids = [submit(client, name=f"seed-{n}")["id"] for n in range(4)]
    client.headers.update(bearer(bob))
    ids.append(submit(client, name="bobs")["id"])
    del client.headers["Authorization"]
    wait_for(lambda: all(job_id in fake.specs for job_id in ids), 10, "the seeded jobs to be dispatched")
    fake.write_log(ids[0], 0, "".join(f"line {n}\n" for n in range(200)))
    fake.write_log(ids[0], 0, "oops\n", stream="err")
    fake.finish(ids[1], {"loss": 0.5})
    cancelled = client.post(f"{JOBS}/{ids[2]}/cancel", headers=bearer(alice))
    assert cancelled.status_code == 200, cancelled.text
    return ids


def test_every_operation_answers_as_its_schema_declares(
    service: Service, settings: Settings, record_property: Callable[[str, object], None]
) -> None:
    client = service.client
    engine = client.app.state.runtime.engine  # type: ignore[attr-defined]
    alice = issue_token(engine, "alice")
    root = issue_token(engine, "root", admin=True)
    ids = seed_jobs(service, alice, issue_token(engine, "bob"))

    schema = schemathesis.openapi.from_dict(client.app.openapi())  # type: ignore[attr-defined]
    on_postgres = settings.resolved_database_url().startswith("postgresql")
    fuzzer = Fuzzer(client, schema, scale=0.25 if on_postgres else 1.0)
    positive, negative = BOTH_MODES
    known_id = st.sampled_from([*ids, 10**6])
    started = time.monotonic()

    for path, method in OPERATIONS:
        fuzzer.cover(path, method, alice)
        fuzzer.fuzz(path, method, positive, 60, alice)
        if path not in NO_NEGATIVE:
            fuzzer.fuzz(path, method, negative, 40, alice)
    fuzzer.cover(JOBS, "POST", alice, modes=[positive], tweak=keep_allowed_target, tag=" +target")
    fuzzer.fuzz(JOBS, "POST", positive, 200, alice, tweak=keep_allowed_target, tag=" +target")
    for path, method in JOB_ID_OPERATIONS:
        fuzzer.fuzz(path, method, positive, 40, alice, tweak=use_job_id, extra=known_id, tag=" +ids")
        fuzzer.fuzz(path, method, positive, 15, root, tweak=use_job_id, extra=known_id, tag=" +ids admin")
    fuzzer.cover("/api/v1/audit", "GET", root, tag=" admin")
    fuzzer.fuzz("/api/v1/audit", "GET", positive, 60, root, tag=" admin")
    fuzzer.fuzz("/api/v1/audit", "GET", negative, 30, root, tag=" admin")
    fuzzer.fuzz(JOBS, "GET", positive, 30, root, tag=" admin")
    for path, method in [(JOBS, "GET"), (JOBS, "POST"), (f"{JOBS}/{{job_id}}", "GET")]:
        fuzzer.fuzz(path, method, positive, 20, None, tag=" any-token")

    elapsed = time.monotonic() - started
    print(f"\nschemathesis: {fuzzer.tally.total} cases in {elapsed:.1f} s\n{fuzzer.tally.report()}")
    record_property("schemathesis_cases", fuzzer.tally.total)  # in the JUnit XML, for CI to chart
    record_property("schemathesis_cases_by_pass", dict(fuzzer.tally.cases))
    wanted = MIN_CASES // 2 if on_postgres else MIN_CASES
    assert fuzzer.tally.total >= wanted, fuzzer.tally.report()
    statuses = fuzzer.tally.all_statuses()
    # The passes reached past validation: accepted jobs and replays, real reads, and every refusal.
    for status in (200, 201, 401, 403, 404, 409, 422):
        assert statuses[status] > 0, f"no {status} among {dict(statuses)}"


# ---------------------------------------------------------------- what the fuzzer found, pinned


@pytest.mark.parametrize(
    "since",
    [
        "2000-01-01T00:00:00+16:00",  # PostgreSQL takes offsets up to ±15:59 only: this was a 500
        "2000-01-01T00:00:00-23:59",
        "0001-01-01T00:00:00+01:00",  # before year 1 in UTC: the calendar's start
        "9999-12-31T23:59:59-10:00",  # after year 9999 in UTC: the calendar's end
        "2000-01-01T00:00:00",  # no zone: UTC, as the ledger stores it
    ],
)
def test_since_takes_any_offset_iso_8601_allows(api: TestClient, since: str) -> None:
    job = submit(api)
    response = api.get(JOBS, params={"since": since})
    assert response.status_code == 200, response.text
    expected = [] if since.startswith("9999") else [job["id"]]
    assert [item["id"] for item in response.json()["items"]] == expected


@pytest.mark.parametrize("since", ["0", "1700000000", "0.5", "-1"])
def test_since_refuses_a_number(api: TestClient, since: str) -> None:
    response = api.get(JOBS, params={"since": since})
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["query", "since"]
    assert "ISO 8601" in response.json()["detail"][0]["msg"]


def test_a_body_that_is_not_utf8_is_refused_like_one_that_is_not_json(api: TestClient) -> None:
    headers = {"Content-Type": "application/json"}
    for body in (b'{"name": "\xff\xfe"}', b"{not json"):
        response = api.post(JOBS, content=body, headers=headers)
        assert response.status_code == 422, response.text
        detail = response.json()["detail"][0]
        assert detail["type"] == "json_invalid" and detail["loc"][0] == "body"


def test_every_api_operation_declares_the_errors_every_route_can_answer(api: TestClient) -> None:
    schema = api.app.openapi()  # type: ignore[attr-defined]
    for path, operations in schema["paths"].items():
        if not path.startswith("/api/v1/"):
            continue
        for method, operation in operations.items():
            declared = set(operation["responses"])
            assert {"401", "403", "422", "503"} <= declared, (method, path, sorted(declared))
            for code in declared - {"200", "201", "304"}:
                content = operation["responses"][code]["content"]
                assert content == {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    backend = schema["components"]["schemas"]["JobCreate"]["properties"]["backend"]
    assert {"enum": ["local", "slurm"], "type": "string"} in backend["anyOf"]


def test_an_env_key_with_a_dot_is_named_whole_in_the_error(api: TestClient) -> None:
    response = api.post(JOBS, json={"name": "j", "entrypoint": ALLOWED_TARGET, "env": {"A.B": "1"}})
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "env", "A.B"]
