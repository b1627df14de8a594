"""Reading the ledger: list (filters, order, pagination), one job, events, logs; unknown ids."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.states import JobState
from tests.fakes import FakeBackend
from tests.support import JOBS, submit, wait_state


def listed(api: TestClient, **params: Any) -> dict[str, Any]:
    response = api.get(JOBS, params=params)
    assert response.status_code == 200, response.text
    page: dict[str, Any] = response.json()
    return page


def ids(page: dict[str, Any]) -> list[int]:
    return [item["id"] for item in page["items"]]


# ---------------------------------------------------------------- list


def test_an_empty_ledger_lists_nothing(api: TestClient) -> None:
    page = listed(api)
    assert page["items"] == [] and page["next_cursor"] is None


def test_jobs_are_listed_newest_first(api: TestClient) -> None:
    created = [submit(api, name=f"job-{n}")["id"] for n in range(4)]

    page = listed(api)

    assert ids(page) == sorted(created, reverse=True)
    assert [item["name"] for item in page["items"]] == ["job-3", "job-2", "job-1", "job-0"]
    assert page["next_cursor"] is None


def test_filter_by_one_or_several_states(api: TestClient, fake: FakeBackend) -> None:
    done, cancelled, failed, running = (submit(api, name=n)["id"] for n in ("a", "b", "c", "d"))
    for job_id in (done, cancelled, failed, running):
        wait_state(api, job_id, "running")
    fake.finish(done, 1)
    fake.set_status(failed, JobState.failed, "exit code 3", exit_code=3)
    assert api.post(f"{JOBS}/{cancelled}/cancel").status_code == 200
    wait_state(api, done, "succeeded")
    wait_state(api, failed, "failed")

    assert ids(listed(api, state="running")) == [running]
    assert ids(listed(api, state="succeeded")) == [done]
    assert ids(listed(api, state=["failed", "cancelled"])) == [failed, cancelled]
    assert ids(listed(api, state="timeout")) == []


def test_filter_by_name_substring(api: TestClient) -> None:
    resnet = submit(api, name="train-resnet")["id"]
    bert = submit(api, name="train-bert")["id"]
    eval_bert = submit(api, name="eval-bert")["id"]
    odd = submit(api, name="100%_done")["id"]

    assert ids(listed(api, name="bert")) == [eval_bert, bert]
    assert ids(listed(api, name="train")) == [bert, resnet]
    assert ids(listed(api, name="0%_")) == [odd]  # LIKE wildcards are matched literally
    assert ids(listed(api, name="%_d")) == [odd]
    assert ids(listed(api, name="t_b")) == []  # `_` is no wildcard: "train-bert" does not match
    assert ids(listed(api, name="BERT")) == [eval_bert, bert]  # A-Z and a-z alike
    assert ids(listed(api, name="gpt")) == []


def test_pagination_walks_every_job_once_newest_first(api: TestClient) -> None:
    created = [submit(api, name=f"p{n}")["id"] for n in range(7)]
    seen: list[int] = []
    pages = 0
    params: dict[str, Any] = {"limit": 3}

    while True:
        page = listed(api, **params)
        pages += 1
        seen += ids(page)
        assert len(page["items"]) <= 3
        if page["next_cursor"] is None:
            break
        params["cursor"] = page["next_cursor"]

    assert pages == 3
    assert seen == sorted(created, reverse=True)


def test_pagination_keeps_the_filter(api: TestClient) -> None:
    wanted = [submit(api, name=f"keep-{n}")["id"] for n in range(3)]
    for n in range(3):
        submit(api, name=f"other-{n}")

    first = listed(api, name="keep", limit=2)
    second = listed(api, name="keep", limit=2, cursor=first["next_cursor"])

    assert ids(first) + ids(second) == sorted(wanted, reverse=True)
    assert second["next_cursor"] is None


@pytest.mark.parametrize(
    "cursor",
    [
        "not a cursor!",
        "%%%",
        base64.urlsafe_b64encode(b"abc").decode(),
        base64.urlsafe_b64encode(b"-5").decode(),
        base64.urlsafe_b64encode(b"0").decode(),
        base64.urlsafe_b64encode(b"9" * 40).decode(),
    ],
)
def test_a_bad_cursor_is_refused(api: TestClient, cursor: str) -> None:
    submit(api)

    response = api.get(JOBS, params={"cursor": cursor})

    assert response.status_code in (400, 422), response.text
    (problem,) = response.json()["detail"]
    assert problem["loc"][-1] == "cursor" and "cursor" in problem["msg"]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": 501}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"state": "sleeping"}, "state"),
        ({"name": "x" * 201}, "name"),
        ({"name": "ab"}, "name"),  # shorter than the name index finds
        ({"name": "é1"}, "name"),
        ({"name": "a\x00b"}, "name"),
    ],
)
def test_bad_list_parameters_are_refused(api: TestClient, params: dict[str, Any], field: str) -> None:
    response = api.get(JOBS, params=params)

    assert response.status_code == 422, response.text
    assert any(field in problem["loc"] for problem in response.json()["detail"])


# ---------------------------------------------------------------- one job and its history


def test_one_job_carries_its_state_timestamps_and_result(api: TestClient, fake: FakeBackend) -> None:
    job_id = submit(api, name="seed")["id"]
    wait_state(api, job_id, "running")
    fake.finish(job_id, {"identical": True})

    job = wait_state(api, job_id, "succeeded")

    assert job["id"] == job_id and job["name"] == "seed"
    assert job["result"] == {"identical": True}
    assert job["exit_code"] == 0
    assert job["attempt"] == 1
    assert job["external_id"] == fake.external_id(job_id)
    assert job["created_at"] <= job["submitted_at"] <= job["started_at"] <= job["finished_at"]
    assert job["reason"] == "completed"
    assert "progress" in job


def test_events_tell_the_whole_history_in_order(api: TestClient, fake: FakeBackend) -> None:
    job_id = submit(api)["id"]
    wait_state(api, job_id, "running")
    fake.finish(job_id, 42)
    wait_state(api, job_id, "succeeded")

    response = api.get(f"{JOBS}/{job_id}/events")

    assert response.status_code == 200
    events = response.json()
    assert [(e["from_state"], e["to_state"]) for e in events] == [
        (None, "queued"),
        ("queued", "submitted"),
        ("submitted", "running"),
        ("running", "succeeded"),
    ]
    assert events[0]["reason"] == "accepted"
    assert fake.external_id(job_id) in events[1]["reason"]
    assert [e["time"] for e in events] == sorted(e["time"] for e in events)
    assert {e["job_id"] for e in events} == {job_id}


@pytest.mark.parametrize("suffix", ["", "/events", "/metrics", "/logs"])
def test_an_unknown_job_is_404_on_every_reader(api: TestClient, suffix: str) -> None:
    submit(api)

    response = api.get(f"{JOBS}/999{suffix}")

    assert response.status_code == 404
    assert response.json()["detail"][0]["msg"] == "job_id: job 999 not found"


def test_an_unknown_job_cannot_be_cancelled(api: TestClient) -> None:
    response = api.post(f"{JOBS}/999/cancel")

    assert response.status_code == 404
    assert "job 999 not found" in response.json()["detail"][0]["msg"]


@pytest.mark.parametrize("job_id", ["0", "-3", "abc", "1.5", str(2**63), "9" * 30])
@pytest.mark.parametrize("suffix", ["", "/events", "/metrics", "/logs"])
def test_a_malformed_job_id_is_refused_not_a_crash(api: TestClient, job_id: str, suffix: str) -> None:
    response = api.get(f"{JOBS}/{job_id}{suffix}")

    assert response.status_code in (404, 422), response.text
    assert response.json()["detail"][0]["loc"][-1] == "job_id"


# ---------------------------------------------------------------- logs


def test_logs_per_rank_with_tail(api: TestClient, fake: FakeBackend) -> None:
    job_id = submit(api, resources={"tasks_per_node": 2})["id"]
    wait_state(api, job_id, "running")
    fake.write_log(job_id, 0, "rank 0 says hi\n")
    fake.write_log(job_id, 1, "".join(f"rank 1 line {n}\n" for n in range(50)))
    fake.write_log(job_id, 1, "Traceback: boom\n", stream="err")

    rank0 = api.get(f"{JOBS}/{job_id}/logs")
    rank1 = api.get(f"{JOBS}/{job_id}/logs", params={"rank": 1, "tail": 2})
    err = api.get(f"{JOBS}/{job_id}/logs", params={"rank": 1, "stream": "err"})
    none = api.get(f"{JOBS}/{job_id}/logs", params={"rank": 1, "tail": 0})

    assert rank0.status_code == 200
    assert rank0.headers["content-type"].startswith("text/plain")
    assert rank0.text == "rank 0 says hi\n"
    assert rank1.text == "rank 1 line 48\nrank 1 line 49\n"
    assert err.text == "Traceback: boom\n"
    assert none.text == ""


def test_logs_of_a_job_not_yet_started_are_empty(api: TestClient, fake: FakeBackend) -> None:
    fake.submit_error = "scheduler down"
    job_id = submit(api)["id"]

    response = api.get(f"{JOBS}/{job_id}/logs")

    assert response.status_code == 200 and response.text == ""


@pytest.mark.parametrize(
    ("params", "field", "message"),
    [
        ({"rank": 2}, "rank", "between 0 and 1"),
        ({"rank": -1}, "rank", "greater than or equal to 0"),
        ({"rank": "one"}, "rank", "valid integer"),
        ({"tail": -1}, "tail", "greater than or equal to 0"),
        ({"stream": "both"}, "stream", "pattern"),
    ],
)
def test_bad_log_parameters_are_refused(
    api: TestClient, params: dict[str, Any], field: str, message: str
) -> None:
    job_id = submit(api, resources={"tasks_per_node": 2})["id"]

    response = api.get(f"{JOBS}/{job_id}/logs", params=params)

    assert response.status_code == 422, response.text
    (problem,) = response.json()["detail"]
    assert problem["loc"][-1] == field and message in problem["msg"]
