"""The client against httpx.MockTransport: URLs, token header, error mapping, pagination, wait."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.client import DEFAULT_URL, TorchyardClient, TorchyardError, WaitTimeout, discover_token
from service.ledger.models.jobs import JobCreate

Handler = Callable[[httpx.Request], httpx.Response]


def client_with(handler: Handler, **kwargs: Any) -> TorchyardClient:
    kwargs.setdefault("token", "")
    return TorchyardClient("http://svc.test", transport=httpx.MockTransport(handler), **kwargs)


def job(job_id: int, state: str = "queued", **extra: Any) -> dict[str, Any]:
    return {"id": job_id, "name": f"job-{job_id}", "state": state, **extra}


@pytest.fixture(autouse=True)
def _no_ambient_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TORCHYARD_URL", raising=False)
    monkeypatch.delenv("TORCHYARD_TOKEN", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


# ---------------------------------------------------------------- configuration and token


def test_base_url_defaults_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TorchyardClient().base_url == DEFAULT_URL
    monkeypatch.setenv("TORCHYARD_URL", "http://elsewhere:9000/")
    assert TorchyardClient().base_url == "http://elsewhere:9000"
    assert TorchyardClient("http://given:1").base_url == "http://given:1"


def test_no_token_sends_no_authorization_header() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=job(1))

    client_with(handler, token=None).get(1)
    assert "authorization" not in seen[0].headers


def test_token_from_env_file_and_argument(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization", ""))
        return httpx.Response(200, json=job(1))

    token_file = tmp_path / "config" / "torchyard" / "token"
    token_file.parent.mkdir(parents=True)
    token_file.write_text("from-file\n")
    assert discover_token() == "from-file"
    client_with(handler, token=None).get(1)
    monkeypatch.setenv("TORCHYARD_TOKEN", "from-env")
    client_with(handler, token=None).get(1)
    client_with(handler, token="given").get(1)
    client_with(handler, token="").get(1)  # explicitly none, whatever the environment says
    assert seen == ["Bearer from-file", "Bearer from-env", "Bearer given", ""]


# ---------------------------------------------------------------- requests


def test_submit_posts_the_spec_and_accepts_a_jobcreate() -> None:
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert (request.method, request.url.path) == ("POST", "/api/v1/jobs")
        assert request.headers.get("idempotency-key") in (None, "k1")
        bodies.append(json.loads(request.content))
        return httpx.Response(201, json=job(7))

    client = client_with(handler)
    assert client.submit({"name": "a", "entrypoint": "m:f"})["id"] == 7
    spec = JobCreate(name="b", entrypoint="m:f", resources={"tasks_per_node": 3})  # type: ignore[arg-type]
    client.submit(spec, idempotency_key="k1")
    assert bodies[0] == {"name": "a", "entrypoint": "m:f"}
    # Only what was set travels: the server keeps choosing defaults (backend, timeout) itself.
    assert bodies[1] == {"name": "b", "entrypoint": "m:f", "resources": {"tasks_per_node": 3}}


def test_list_sends_filters_as_query_parameters() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        params = request.url.params
        assert params.get_list("state") == ["running", "queued"]
        assert (params["name"], params["limit"], params["cursor"]) == ("train", "5", "abc")
        return httpx.Response(200, json={"items": [job(3)], "next_cursor": None})

    page = client_with(handler).list(state=["running", "queued"], name="train", limit=5, cursor="abc")
    assert page["items"][0]["id"] == 3


def test_iter_jobs_follows_next_cursor_to_the_end() -> None:
    pages = {None: ([5, 4], "c4"), "c4": ([3, 2], "c2"), "c2": ([1], None)}
    cursors: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        cursor = request.url.params.get("cursor")
        cursors.append(cursor)
        ids, next_cursor = pages[cursor]
        return httpx.Response(200, json={"items": [job(i) for i in ids], "next_cursor": next_cursor})

    ids = [j["id"] for j in client_with(handler).iter_jobs(page_size=2)]
    assert ids == [5, 4, 3, 2, 1]
    assert cursors == [None, "c4", "c2"]


def test_logs_events_metrics_cancel_health() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        path, params = request.url.path, request.url.params
        if path == "/api/v1/jobs/2/logs":
            assert (params["rank"], params["tail"], params["stream"]) == ("1", "3", "err")
            return httpx.Response(200, text="a\nb\nc\n")
        if path == "/api/v1/jobs/2/events":
            return httpx.Response(200, json=[{"to_state": "queued"}])
        if path == "/api/v1/jobs/2/metrics":
            assert params["name"] == "loss"
            return httpx.Response(200, json=[{"step": 1, "name": "loss", "value": 0.5}])
        if path == "/api/v1/jobs/2/cancel":
            assert request.method == "POST"
            return httpx.Response(200, json=job(2, "cancelled"))
        if path == "/healthz":
            return httpx.Response(503, json={"status": "degraded"})
        return httpx.Response(404, json={"detail": "Not Found"})

    client = client_with(handler)
    assert client.logs(2, rank=1, tail=3, stream="err") == "a\nb\nc\n"
    assert client.events(2) == [{"to_state": "queued"}]
    assert client.metrics(2, name="loss")[0]["value"] == 0.5
    assert client.cancel(2)["state"] == "cancelled"
    assert client.health() == {"status": "degraded"}  # a degraded service still answers


def test_metric_series_asks_for_points_and_a_range() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        params = dict(request.url.params)
        assert request.url.path == "/api/v1/jobs/2/metrics"
        assert params == {"points": "800", "from_step": "100", "to_step": "900"}
        return httpx.Response(200, json={"points": 800, "from_step": 100, "to_step": 900, "series": []})

    assert client_with(handler).metric_series(2, 800, from_step=100, to_step=900)["points"] == 800


# ---------------------------------------------------------------- errors


def test_validation_errors_name_the_field() -> None:
    detail = [
        {"loc": ["body", "resources", "nodes"], "msg": "Input should be greater than or equal to 1"},
        {"loc": ["body", "script"], "msg": "script: no such file: /nope.py", "type": "value_error"},
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(422, json={"detail": detail})

    with pytest.raises(TorchyardError) as caught:
        client_with(handler).submit({"name": "x"})
    error = caught.value
    assert error.status == 422
    assert error.detail == detail
    # pydantic's loc becomes a field path; the service's own messages already carry it once.
    assert error.message == (
        "resources.nodes: Input should be greater than or equal to 1; script: no such file: /nope.py"
    )
    assert str(error).startswith("422: resources.nodes")


@pytest.mark.parametrize(
    ("response", "message"),
    [
        (
            httpx.Response(404, json={"detail": [{"loc": ["job_id"], "msg": "job 9 gone"}]}),
            "job_id: job 9 gone",
        ),
        (httpx.Response(401, json={"detail": "missing token"}), "missing token"),
        (httpx.Response(502, text="Bad Gateway from the proxy"), "Bad Gateway from the proxy"),
        (httpx.Response(500, text=""), "Internal Server Error"),
    ],
)
def test_error_bodies_of_every_shape(response: httpx.Response, message: str) -> None:
    with pytest.raises(TorchyardError) as caught:
        client_with(lambda request: response).get(9)
    assert (caught.value.status, caught.value.message) == (response.status_code, message)


def test_unreachable_service_is_a_torchyard_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(TorchyardError) as caught:
        client_with(handler).get(1)
    assert caught.value.status is None
    assert "cannot reach torchyard at http://svc.test" in caught.value.message


def test_non_json_success_body_is_reported_not_crashed_on() -> None:
    with pytest.raises(TorchyardError, match="expected JSON"):
        client_with(lambda request: httpx.Response(200, text="<html>login</html>")).get(1)


# ---------------------------------------------------------------- wait


def test_wait_polls_until_terminal_and_reports_every_poll() -> None:
    states = iter(["queued", "running", "running", "succeeded"])

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=job(4, next(states)))

    seen: list[str] = []
    final = client_with(handler).wait(4, on_update=lambda j: seen.append(j["state"]), poll_s=0)
    assert final["state"] == "succeeded"
    assert seen == ["queued", "running", "running", "succeeded"]


def test_wait_long_polls_with_the_last_etag_and_waits_out_a_304() -> None:
    asked: list[tuple[str | None, str | None]] = []
    answers = iter(
        [
            httpx.Response(200, json=job(4, "running"), headers={"ETag": '"r"'}),
            httpx.Response(304, headers={"ETag": '"r"'}),  # the wait ran out with nothing new
            httpx.Response(200, json=job(4, "succeeded"), headers={"ETag": '"s"'}),
        ]
    )

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append((request.headers.get("if-none-match"), request.url.params.get("wait_s")))
        return next(answers)

    seen: list[str] = []
    final = client_with(handler).wait(4, on_update=lambda j: seen.append(j["state"]), poll_s=0)
    assert final["state"] == "succeeded"
    assert seen == ["running", "running", "succeeded"]
    # The first read has no tag to wait on; then each round is held by the service (20 s at most).
    assert asked == [(None, None), ('"r"', "20.0"), ('"r"', "20.0")]


def test_wait_gives_up_at_its_timeout() -> None:
    with pytest.raises(WaitTimeout, match="still running"):
        client_with(lambda request: httpx.Response(200, json=job(4, "running"))).wait(
            4, poll_s=0.01, timeout_s=0.05
        )


def test_get_revalidates_with_the_etag_and_reuses_the_body_on_304() -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("if-none-match"))
        if request.headers.get("if-none-match") == '"v1"':
            return httpx.Response(304, headers={"ETag": '"v1"'})
        return httpx.Response(200, json=job(5, "running"), headers={"ETag": '"v1"'})

    client = client_with(handler)
    first = client.get(5)
    first["state"] = "changed by the caller"
    assert client.get(5)["state"] == "running"  # from the cache, untouched by the caller's edit
    assert seen == [None, '"v1"']


def test_whoami_and_audit_call_their_endpoints() -> None:
    seen: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, str(request.url.params)))
        if request.url.path == "/api/v1/whoami":
            return httpx.Response(200, json={"user": "alice", "admin": False})
        return httpx.Response(200, json=[{"id": 1, "actor": "alice", "action": "job.submit"}])

    with client_with(handler, token="t") as client:
        me = client.whoami()
        entries = client.audit(actor="alice", limit=5)

    assert me == {"user": "alice", "admin": False} and entries[0]["action"] == "job.submit"
    assert seen == [("/api/v1/whoami", ""), ("/api/v1/audit", "limit=5&actor=alice")]


# ---------------------------------------------------------------- code snapshots


def test_upload_code_sends_the_archive_only_when_the_service_lacks_it(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("def main(ctx):\n    return 1\n")
    stored: dict[str, bytes] = {}
    seen: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path))
        code_id = request.url.path.rsplit("/", 1)[-1]
        if request.method == "GET":
            return httpx.Response(200 if code_id in stored else 404, json={"id": code_id, "detail": []})
        body = request.read()
        made = "sha256:" + hashlib.sha256(body).hexdigest()
        stored[made] = body
        return httpx.Response(201, json={"id": made, "bytes": len(body), "files": 1})

    progress: list[tuple[int, int]] = []
    with client_with(handler) as client:
        first = client.upload_code(tmp_path, progress=lambda sent, total: progress.append((sent, total)))
        again = client.upload_code(tmp_path)

    assert first == again and first.startswith("sha256:")
    assert [method for method, _ in seen] == ["GET", "POST", "GET"]  # the second found it there
    assert progress and progress[-1][0] == progress[-1][1] == len(stored[first])


def test_a_saved_token_is_its_owners_alone_and_a_link_in_its_place_is_replaced_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.client.wire import save_token, token_path

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    token_path().parent.mkdir(parents=True)
    token_path().symlink_to(victim)

    path = save_token("ty_new")

    assert victim.read_text() == "keep me\n"
    assert not path.is_symlink() and path.read_text() == "ty_new\n"
    assert path.stat().st_mode & 0o777 == 0o600
