"""Stacks on demand with real ranks on the local backend, run as their owner's account (the signal
goes out as alice): rank 1 of 3 sleeps in a function of the job's own script while ranks 0 and 2 wait
in all_reduce. The route names rank 1's function and line and puts 0 and 2 in one group; bob gets 404;
a rank that floods its stacks file costs a bounded read and a note; the job, once cancelled, shows its
last capture. The time a capture takes is printed (run with -s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.hung_job import (
    REGEX_LINE,
    STUCK_LINE,
    ended,
    hung_capture,
    place_script,
    submit_hang,
    timed_captures,
)
from tests.integration.isolation import isolated_settings, live_service

pytestmark = pytest.mark.integration


def test_a_hung_rank_is_named_and_the_waiting_ranks_grouped(shared_root: Path) -> None:
    script = place_script(shared_root)
    with live_service(isolated_settings(shared_root, "local")) as server, server.client("alice") as alice:
        job_id = submit_hang(alice, script, tasks_per_node=3)
        capture = hung_capture(alice, job_id, world=3)
        measured = timed_captures(alice, job_id)
        with server.client("bob") as bob:
            others = bob.get(f"/api/v1/jobs/{job_id}/stacks")
        last = alice.get(f"/api/v1/jobs/{job_id}/stacks").json()
        assert alice.post(f"/api/v1/jobs/{job_id}/cancel").status_code == 200
        ended(alice, job_id)
        after = alice.get(f"/api/v1/jobs/{job_id}/stacks")

    assert [group["ranks"] for group in capture["groups"]][:1] == [[1]]
    assert [0, 2] in [group["ranks"] for group in capture["groups"]]
    frame = capture["groups"][0]["threads"]
    assert any(f["function"] == "stuck" and f["line"] == STUCK_LINE for t in frame for f in t["frames"])
    assert f"hang_rank.py:{STUCK_LINE} stuck" in capture["summary"] and "rank 1" in capture["summary"]
    assert all(rank["host"] for rank in capture["ranks"])
    assert all(took < 3.5 and wall < 5 for wall, took in measured)
    assert others.status_code == 404
    assert after.status_code == 200, after.text
    shown = after.json()
    assert shown["fresh"] is False and shown["captured_at"] == last["captured_at"]
    assert shown["groups"] == last["groups"]


def test_a_rank_flooding_its_stacks_file_costs_a_bounded_read_and_a_note(shared_root: Path) -> None:
    script = place_script(shared_root)
    with live_service(isolated_settings(shared_root, "local")) as server, server.client("alice") as alice:
        job_id = submit_hang(alice, script, "--hostile", tasks_per_node=2)
        noted = lambda capture, rank: bool(capture["ranks"][rank]["note"])  # noqa: E731
        capture = hung_capture(alice, job_id, world=2, waiting=noted)
        alice.post(f"/api/v1/jobs/{job_id}/cancel")
        ended(alice, job_id)

    notes = {rank["rank"]: rank["note"] for rank in capture["ranks"]}
    assert notes[0] and "bytes" in notes[0] and "KiB" in notes[0]
    assert notes[1] is None
    assert "\x00" not in str(capture)


def test_eight_ranks_are_captured_within_seconds(shared_root: Path) -> None:
    script = place_script(shared_root)
    with live_service(isolated_settings(shared_root, "local")) as server, server.client("alice") as alice:
        job_id = submit_hang(alice, script, tasks_per_node=8)
        capture = hung_capture(alice, job_id, world=8, timeout=400)
        measured = timed_captures(alice, job_id)
        alice.post(f"/api/v1/jobs/{job_id}/cancel")
        ended(alice, job_id)

    assert [group["ranks"] for group in capture["groups"]] == [[1], [0, *range(2, 8)]]
    assert "ranks 0, 2-7" in capture["summary"]
    assert all(took < 3.5 for _, took in measured)


def test_a_rank_stuck_in_c_code_holding_the_gil_still_gets_its_stack(shared_root: Path) -> None:
    """faulthandler's handler is C and needs no GIL: rank 1 in a catastrophic regex answers as well."""
    script = place_script(shared_root)
    with live_service(isolated_settings(shared_root, "local")) as server, server.client("alice") as alice:
        job_id = submit_hang(alice, script, "--regex", tasks_per_node=2)
        capture = hung_capture(alice, job_id, world=2, function="stuck_in_regex")
        alice.post(f"/api/v1/jobs/{job_id}/cancel")
        ended(alice, job_id)

    assert sorted(group["ranks"] for group in capture["groups"]) == [[0], [1]]
    assert f"hang_rank.py:{REGEX_LINE} stuck_in_regex" in capture["summary"]
