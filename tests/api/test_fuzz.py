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

Two more passes, each a test of its own, printing its figures too:
- hostile bodies, sent as raw bytes (a JSON escape for a lone surrogate, NaN / Infinity tokens, NUL,
  kwargs 500 deep, out-of-range resources, no JSON and no token): each gets its status, the field its
  422 names, and the checks above; none stores a job, and the owner's and the admin's lists still read;
- stateful: schemathesis's state machine over links the test declares on the served schema (create ->
  read, events, metrics, logs, cancel, list by name; read -> cancel; cancel -> read, list; list ->
  read), each scenario as a user of its own; the chains must be walked on the jobs the scenarios made,
  and none of those may answer 404 to its owner.
"""

from __future__ import annotations

import copy
import functools
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import schemathesis
import sqlalchemy as sa
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.parameters import ParameterLocation
from schemathesis.generation.stateful.state_machine import APIStateMachine, StepInput, StepOutput
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from service.app import create_app
from service.backends.base import StackRequest
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
    (f"{JOBS}/{{job_id}}/stacks", "GET"),
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
    fake.on_stacks = functools.partial(ranks_dump, fake)  # a capture answers at once, not after 3 s
    app = create_app(roomy, backends={"local": fake, "slurm": FakeBackend("slurm")})
    with TestClient(app) as client:
        yield Service(client, fake)


def ranks_dump(fake: FakeBackend, job: StackRequest) -> bool:
    """Every rank of the signalled job appends a stack to its stacks file, as faulthandler does."""
    spec = next(spec for spec in fake.specs.values() if fake.external_id(spec.job_id) == job.external_id)
    for rank in range(spec.resources.world_size):
        path = spec.files.stacks(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as out:
            out.write('Current thread 0x1 (most recent call first):\n  File "t.py", line 1 in f\n')
    return True


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


# ---------------------------------------------------------------- hostile clients, as explicit cases


def raw_job(**fields: bytes) -> bytes:
    """A job's JSON as the bytes a client writes, each field's value verbatim (escapes, NaN and all)."""
    merged = {"name": b'"j"', "entrypoint": b'"' + ALLOWED_TARGET.encode() + b'"', **fields}
    return b"{" + b",".join(b'"%s":%s' % (name.encode(), value) for name, value in merged.items()) + b"}"


@dataclass(frozen=True)
class Hostile:
    """A body as a hostile client writes it, sent as raw bytes, and the answer it must get.

    Raw bytes, because httpx's JSON encoder refuses NaN and cannot encode a lone surrogate: the
    generated passes never send either.
    """

    name: str
    body: bytes
    status: int
    where: tuple[str, ...] = ()  # how the loc of one problem in the 422 starts
    says: str = ""  # what that problem's message names
    token: bool = True


DEEP = b'{"a":' * 500 + b"{}" + b"}" * 500
HOSTILE = [
    # JSON escapes the server decodes to a lone surrogate: no UTF-8 encoder can write it back out.
    Hostile("surrogate kwarg", raw_job(kwargs=rb'{"note":"\ud800"}'), 422, ("body", "kwargs"), "kwargs.note"),
    Hostile("surrogate name", raw_job(name=rb'"\ud800"'), 422, ("body", "name")),
    Hostile("kwargs 500 deep", raw_job(kwargs=DEEP), 422, ("body", "kwargs"), "deeper"),
    # Python's json module reads these tokens; JSON has no such values and no client could read them back.
    Hostile("NaN kwarg", raw_job(kwargs=b'{"loss":NaN}'), 422, ("body", "kwargs"), "kwargs.loss"),
    Hostile("Infinity kwarg", raw_job(kwargs=b'{"lr":Infinity}'), 422, ("body", "kwargs"), "kwargs.lr"),
    Hostile(
        "-Infinity listed", raw_job(kwargs=b'{"lr":[-Infinity]}'), 422, ("body", "kwargs"), "kwargs.lr.0"
    ),
    Hostile("NUL in a kwarg", raw_job(kwargs=rb'{"note":"a\u0000b"}'), 422, ("body", "kwargs"), "NUL"),
    Hostile("mem_gb 1e308", raw_job(resources=b'{"mem_gb":1e308}'), 422, ("body", "resources", "mem_gb")),
    Hostile(
        "cpus_per_task 1e5",
        raw_job(resources=b'{"cpus_per_task":100000}'),
        422,
        ("body", "resources", "cpus_per_task"),
    ),
    # The token comes first: a stranger learns nothing about what the body would have been told.
    Hostile("not JSON, no token", b'{"name": "j", ', 401, token=False),
]


def listed_ids(client: TestClient, token: str) -> list[int]:
    response = client.get(JOBS, params={"limit": 500}, headers=bearer(token))
    assert response.status_code == 200, response.text
    return [item["id"] for item in response.json()["items"]]


def test_hostile_bodies_are_refused_as_declared_and_store_nothing(service: Service) -> None:
    """tests/api/test_hostile_input.py pins the messages; here the schema checks run on the answers too."""
    client = service.client
    engine = client.app.state.runtime.engine  # type: ignore[attr-defined]
    alice = issue_token(engine, "alice")
    root = issue_token(engine, "root", admin=True)
    # Jobs finished, cancelled, with logs, and one of bob's: every one of them must still render.
    seed_jobs(service, alice, issue_token(engine, "bob"))
    before = {alice: listed_ids(client, alice), root: listed_ids(client, root)}
    assert len(before[root]) > len(before[alice]) > 0, before

    schema = schemathesis.openapi.from_dict(client.app.openapi())  # type: ignore[attr-defined]
    operation = schema[JOBS]["POST"]
    tally = Tally()
    for hostile in HOSTILE:
        # A bytes body goes out as it is; the Case is there for the response checks.
        case = operation.Case(
            body=hostile.body,
            media_type="application/json",
            headers={"authorization": f"Bearer {alice}"} if hostile.token else {},
        )
        response = send(client, case)
        tally.add(f"hostile: {hostile.name}", response.status_code)
        assert response.status_code == hostile.status, (hostile.name, response.text)
        case.validate_response(response, checks=CHECKS)
        if hostile.where:
            problems = response.json()["detail"]
            where, says = hostile.where, hostile.says
            assert any(
                tuple(problem["loc"][: len(where)]) == where and says in problem["msg"]
                for problem in problems
            ), (hostile.name, problems)

    print(f"\nhostile POST {JOBS}: {tally.total} cases\n{tally.report()}")
    # Nothing stored, and every list (the owner's and the admin's) still reads, each job in it too.
    for token, ids in before.items():
        assert listed_ids(client, token) == ids, token
        for job_id in ids:
            read = client.get(f"{JOBS}/{job_id}", headers=bearer(token))
            assert read.status_code == 200, read.text


# ---------------------------------------------------------------- stateful: create, read, cancel, list

JOB = f"{JOBS}/{{job_id}}"
NOBODYS_JOB = 2**62  # within the schema's range, and no test's ledger gets there


def with_links(served: dict[str, Any]) -> dict[str, Any]:
    """The served schema plus the links a client follows from a job it created.

    Declared here, not inferred: what the phase walks must not change with schemathesis's heuristics.
    """
    spec = copy.deepcopy(served)
    paths = spec["paths"]

    def to(path: str, method: str, **parameters: str) -> dict[str, Any]:
        return {"operationId": paths[path][method]["operationId"], "parameters": parameters}

    by_id = {"path.job_id": "$response.body#/id"}
    reads = {
        "GetJob": to(JOB, "get", **by_id),
        "GetEvents": to(f"{JOB}/events", "get", **by_id),
        "GetMetrics": to(f"{JOB}/metrics", "get", **by_id),
        "GetLogs": to(f"{JOB}/logs", "get", **by_id),
        # By name, so the page is one that should hold the job just created or cancelled.
        "ListByName": to(JOBS, "get", **{"query.name": "$response.body#/name"}),
    }
    cancel = {"CancelJob": to(f"{JOB}/cancel", "post", **by_id)}
    # 200 is the replay of an Idempotency-Key: the same job, so the same links.
    for code in ("200", "201"):
        paths[JOBS]["post"]["responses"][code]["links"] = {**reads, **cancel}
    paths[JOB]["get"]["responses"]["200"]["links"] = cancel
    paths[f"{JOB}/cancel"]["post"]["responses"]["200"]["links"] = {
        "GetJob": reads["GetJob"],
        "ListByName": reads["ListByName"],
    }
    paths[JOBS]["get"]["responses"]["200"]["links"] = {
        "GetListed": to(JOB, "get", **{"path.job_id": "$response.body#/items/0/id"})
    }
    return spec


@dataclass
class Walk:
    """What the stateful scenarios sent and created, and the links they followed."""

    client: TestClient
    engine: sa.Engine
    tally: Tally = field(default_factory=Tally)
    scenarios: int = 0
    created: int = 0
    followed: Counter[str] = field(default_factory=Counter)  # link -> steps it supplied a value to
    to_own_job: Counter[str] = field(default_factory=Counter)  # link -> of those, on a job made in it


def is_positive(case: Case[Any]) -> bool:
    return case.meta is not None and case.meta.generation.mode is GenerationMode.POSITIVE


def workflow(base: type[APIStateMachine], walk: Walk) -> type[APIStateMachine]:
    """schemathesis's state machine, sending through our TestClient, each scenario as a user of its own.

    Hypothesis replays the start of one scenario at the start of another and requires the same draws
    to follow: a bundle left empty, or an id extracted the first time and not the second, is
    FlakyStrategyDefinition. A fresh user has nothing to list, no Idempotency-Key used, no job to
    find, so every scenario meets the same service whatever ran before it; and a job it makes is in
    its steady state before the next step (settle), whatever pace the service's loops keep.
    """

    class Workflow(base):  # type: ignore[misc, valid-type]
        def setup(self) -> None:
            walk.scenarios += 1
            self.token = issue_token(walk.engine, f"walker{walk.scenarios}")
            self.jobs: set[int] = set()

        def before_call(self, case: Case[Any]) -> None:
            case.headers["authorization"] = f"Bearer {self.token}"
            # Positive bodies only: a negative one must stay as wrong as it was made.
            if case.path == JOBS and case.method == "POST" and is_positive(case):
                keep_allowed_target(case, None)

        def call(self, case: Case[Any], **kwargs: Any) -> schemathesis.Response:
            return schemathesis.Response.from_any(send(walk.client, case))

        def after_call(self, response: schemathesis.Response, case: Case[Any]) -> None:
            super().after_call(response, case)  # recorded: stateful checks look up the parent step
            walk.tally.add(f"{case.method} {case.path} stateful", response.status_code)
            if case.path == JOBS and case.method == "POST" and response.status_code == 201:
                walk.created += 1
                self.jobs.add(response.json()["id"])
                self.settle(response.json()["id"])

        def settle(self, job_id: int) -> None:
            """Wait until the dispatcher and the reconciler have moved the new job where it stays
            (the fake backend's `running`; `waiting` behind a dependency) until the scenario cancels it.
            A later step may draw a state filter: on Hypothesis's replay of this scenario the list it
            reads must hold the job or not as it did the first time, else the link from that list is
            followed once and not the next time, and the draws after it differ (FlakyStrategyDefinition)."""
            auth = {"authorization": f"Bearer {self.token}"}

            def steady() -> bool:
                state = walk.client.get(f"{JOBS}/{job_id}", headers=auth).json()["state"]
                return state in ("running", "waiting")

            wait_for(steady, 10, f"job {job_id} to be dispatched and running")

        def validate_response(
            self, response: schemathesis.Response, case: Case[Any], *args: Any, **kwargs: Any
        ) -> None:
            # The checks of the other passes. schemathesis's default set adds positive_data_acceptance,
            # which fails on a policy's 422 (more nodes than max_nodes) that no schema can express.
            case.validate_response(response, checks=CHECKS, recorder=self.recorder)

        def step(self, input: StepInput) -> StepOutput:
            case = input.case
            linked = (ParameterLocation.PATH, "job_id") in input.applied_parameters
            if not linked and (case.path_parameters or {}).get("job_id") in self.jobs:
                # A drawn id that names a job of this scenario by chance (ids start at 1, and so do
                # drawn integers): on Hypothesis's replay that job has another id, and 200 turns 404.
                case.path_parameters = {**case.path_parameters, "job_id": NOBODYS_JOB}
            output: StepOutput = super().step(input)
            if input.transition is None or not input.is_applied:
                return output
            link = input.transition.id.rsplit(" -> ", 1)[0]  # "POST /api/v1/jobs -> [201] GetJob"
            walk.followed[link] += 1
            if linked and case.path_parameters["job_id"] in self.jobs:
                walk.to_own_job[link] += 1
                # The owner, with the id from the answer that made the job: it must be found.
                assert output.response.status_code != 404, (link, output.response.text)
            return output

    return Workflow


def test_links_from_a_created_job_lead_to_it(service: Service, settings: Settings) -> None:
    client = service.client
    engine = client.app.state.runtime.engine  # type: ignore[attr-defined]
    walk = Walk(client, engine)
    # Inference off: only the declared links, the same on every schemathesis release.
    config = schemathesis.Config.from_dict({"phases": {"stateful": {"inference": {"algorithms": []}}}})
    served = client.app.openapi()  # type: ignore[attr-defined]
    schema = schemathesis.openapi.from_dict(with_links(served), config=config)
    machine = workflow(schema.as_state_machine(), walk)
    started = time.monotonic()
    # Which link a step follows depends on what the service answered, and its loops move jobs on
    # meanwhile: a run can miss a link that it usually takes. A longer run draws the same scenarios
    # first and more after them, so the walk goes on until every link below has led somewhere.
    for examples in (50, 100, 200):
        machine.run(
            settings=hypothesis_settings(
                max_examples=examples,
                stateful_step_count=10,
                derandomize=True,
                database=None,
                deadline=None,
                # No shrinking, as schemathesis runs state machines: its replays of a failing
                # scenario meet jobs the service's loops have moved on meanwhile, and can end in
                # Flaky instead.
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
        )
        if not _links_missing(walk):
            break
    elapsed = time.monotonic() - started
    print(
        f"\nstateful: {walk.tally.total} calls in {elapsed:.1f} s, {walk.scenarios} scenarios, "
        f"{walk.created} jobs created\n{walk.tally.report()}\nlinks followed (to a job of the scenario):"
    )
    for link, count in sorted(walk.followed.items()):
        print(f"  {link}: {count} ({walk.to_own_job[link]})")
    assert walk.created > 0, walk.tally.report()
    assert not _links_missing(walk), (_links_missing(walk), walk.to_own_job, walk.followed)
    statuses = walk.tally.all_statuses()
    assert statuses[201] > 0 and statuses[200] > 0, dict(statuses)


def _links_missing(walk: Walk) -> list[str]:
    """The links the walk must have followed and has not: create -> read, create -> cancel,
    read -> cancel and cancel -> read, each on the job made before it, and create -> list."""
    own_job = (
        f"POST {JOBS} -> [201] GetJob",
        f"POST {JOBS} -> [201] CancelJob",
        f"GET {JOB} -> [200] CancelJob",
        f"POST {JOB}/cancel -> [200] GetJob",
    )
    missing = [link for link in own_job if walk.to_own_job[link] == 0]
    if walk.followed[f"POST {JOBS} -> [201] ListByName"] == 0:
        missing.append(f"POST {JOBS} -> [201] ListByName")
    return missing


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
