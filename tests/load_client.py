"""Many concurrent submitters against a live service: what each POST answered, for the test to check.

Every client is one user with a token of its own and one HTTP connection pool; it submits its jobs
one after another. Every other job carries an Idempotency-Key and is sent twice: alternately the
retry follows the answer (a client that timed out and tries again) or both go at once (two
replicas of a client racing).

The clients run in a process of their own (`python -m tests.load_client`, tokens on stdin, answers
as JSON lines on stdout): in the service's process they would share its interpreter lock, and the
figure would be half the clients' cost, not the service's throughput.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

JOBS = "/api/v1/jobs"
ENTRYPOINT = "worker.tasks.seed:ddp_step"


@dataclass(frozen=True)
class Answer:
    """One POST: which job request it carried, whether it was the retry, and what came back."""

    user: str
    index: int  # the job's number within its user's submissions
    key: str | None
    retry: bool
    concurrent: bool
    status: int
    job_id: int | None
    body: str


@dataclass
class LoadResult:
    answers: list[Answer] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def posts(self) -> int:
        return len(self.answers)


def job_body(user: str, index: int) -> dict[str, Any]:
    return {"name": f"{user}-{index}", "entrypoint": ENTRYPOINT, "kwargs": {"n": index}}


def idempotency_key(user: str, index: int) -> str | None:
    return f"{user}-job-{index}" if index % 2 == 0 else None


async def _post(client: httpx.AsyncClient, user: str, index: int, retry: bool, concurrent: bool) -> Answer:
    key = idempotency_key(user, index)
    headers = {"Idempotency-Key": key} if key else {}
    response = await client.post(JOBS, json=job_body(user, index), headers=headers)
    job_id = response.json().get("id") if response.status_code in (200, 201) else None
    return Answer(user, index, key, retry, concurrent, response.status_code, job_id, response.text[:300])


async def _submitter(url: str, user: str, token: str, jobs: int, timeout_s: float) -> list[Answer]:
    answers: list[Answer] = []
    limits = httpx.Limits(max_connections=2, max_keepalive_connections=2)  # the pair of a racing retry
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s, limits=limits) as client:
        for index in range(jobs):
            if idempotency_key(user, index) is None:
                answers.append(await _post(client, user, index, retry=False, concurrent=False))
            elif index % 4 == 0:  # send, then the same request again once the answer is in
                answers.append(await _post(client, user, index, retry=False, concurrent=False))
                answers.append(await _post(client, user, index, retry=True, concurrent=False))
            else:  # both at once: which one is "first" is the service's business
                pair = await asyncio.gather(
                    _post(client, user, index, retry=False, concurrent=True),
                    _post(client, user, index, retry=True, concurrent=True),
                )
                answers.extend(pair)
    return answers


async def _load(url: str, tokens: dict[str, str], jobs: int, timeout_s: float) -> list[Answer]:
    per_user = await asyncio.gather(
        *(_submitter(url, user, token, jobs, timeout_s) for user, token in tokens.items())
    )
    return [answer for answers in per_user for answer in answers]


def run_load(
    url: str, tokens: dict[str, str], jobs_per_user: int, timeout_s: float = 30.0, deadline_s: float = 240.0
) -> LoadResult:
    """One submitter per (user, token), all at once, in a child process; fails after `deadline_s`."""
    command = [
        sys.executable,
        "-m",
        "tests.load_client",
        url,
        str(jobs_per_user),
        str(timeout_s),
        str(deadline_s),
    ]
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        command, input=json.dumps(tokens), capture_output=True, text=True, cwd=root, timeout=deadline_s + 60
    )
    if done.returncode != 0:
        raise RuntimeError(f"the load clients failed ({done.returncode}): {done.stderr[-3000:]}")
    *lines, summary = done.stdout.splitlines()
    answers = [Answer(**json.loads(line)) for line in lines]
    return LoadResult(answers=answers, seconds=float(json.loads(summary)["seconds"]))


def main(argv: list[str]) -> None:
    url, jobs, timeout_s, deadline_s = argv[0], int(argv[1]), float(argv[2]), float(argv[3])
    tokens: dict[str, str] = json.loads(sys.stdin.read())
    started = time.monotonic()
    answers = asyncio.run(asyncio.wait_for(_load(url, tokens, jobs, timeout_s), deadline_s))
    seconds = time.monotonic() - started
    out = sys.stdout
    for answer in answers:
        out.write(json.dumps(dataclasses.asdict(answer)) + "\n")
    out.write(json.dumps({"seconds": seconds}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
