"""mallory, the noisy neighbour of issue 43: everything one token holder could do to hold what the
service shares between users, at once, bounded in count and in time.

- a running job of hers whose rank ignores SIGURG (tests/data/deaf_rank.py), and FLOOD requests at
  its stacks at all times (each capture waits its whole deadline);
- webhooks to a slow-drip receiver (a byte a second, never done) on every state of every job of
  hers, as many subscriptions as her cap allows and a few more;
- jobs from a small code archive that unpacks to 60 MiB;
- UPLOADS concurrent uploads of code;
- STALLING jobs whose rank ignores SIGURG, with a watchdog that fails them once stalled.

Her requests go from an event loop in a process of her own; each refused one (409/429) waits its
Retry-After (at most 3 s) before the next, as a client library would, so that the flood costs the
service what a stream of refusals costs, not a busy loop of the test's own.
"""

from __future__ import annotations

import asyncio
import io
import multiprocessing
import os
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from tests.integration.neighbour import JOBS, SUBSCRIPTIONS, Neighbours
from tests.support import ROOT, bearer

DEAF = str(ROOT / "tests" / "data" / "deaf_rank.py")
FLOOD = 200  # stacks requests at once
UPLOADS = 30  # code uploads at once
UPLOAD_BYTES = 2 << 20  # each (random: it stays that large compressed)
CODE_JOBS = 6
UNPACKED_BYTES = 60 << 20  # what the small archive unpacks to (zeros: a few dozen KiB packed)
STALLING = 3
SUBSCRIPTIONS_TRIED = 40  # more than her cap (neighbour.CAPS)
MAX_PAUSE_S = 3.0
DEAF_JOB: dict[str, Any] = {"script": DEAF, "resources": {"timeout_min": 5}, "retries": {"max": 0}}


@dataclass(frozen=True)
class Answer:
    status: int
    retry_after: str | None
    body: str


class Flag(Protocol):
    """A threading.Event, or a multiprocessing one."""

    def set(self) -> None: ...
    def is_set(self) -> bool: ...


@dataclass
class Noise:
    """What each kind of mallory's requests got back, and why her noise failed if it did."""

    answers: dict[str, list[Answer]] = field(default_factory=dict)
    failure: str | None = None

    def record(self, kind: str, response: httpx.Response) -> Answer:
        answer = Answer(response.status_code, response.headers.get("retry-after"), response.text[:300])
        self.answers.setdefault(kind, []).append(answer)
        return answer


@contextmanager
def mallory_noise(place: Neighbours, drip_url: str, stacks_job: int) -> Iterator[Noise]:
    """mallory's noise from the moment her jobs are submitted until the block ends (her flood at
    `stacks_job`'s stacks until then, her webhooks to `drip_url`); what she got back once it ended.

    She runs in a process of her own: on a thread of the test she would share alice's interpreter
    lock, and alice would measure the test's own contention."""
    spawn = multiprocessing.get_context("spawn")
    started, stop, told = spawn.Event(), spawn.Event(), spawn.Queue()
    args = (place.url, place.mallory.token, drip_url, stacks_job, started, stop, told)
    process = spawn.Process(target=_run, args=args, name="mallory", daemon=True)
    process.start()
    noise = Noise()
    try:
        if not started.wait(120):
            noise.failure = "mallory did not start within 120 s"
        yield noise
    finally:
        stop.set()
        try:
            noise.answers, failure = told.get(timeout=150)
            noise.failure = noise.failure or failure
        finally:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()


def _run(url: str, token: str, drip_url: str, stacks_job: int, started: Flag, stop: Flag, told: Any) -> None:
    noise = Noise()
    try:
        asyncio.run(_noise(url, token, drip_url, stacks_job, noise, started, stop))
    except BaseException as error:  # the test reads it: a child's error is lost otherwise
        noise.failure = repr(error)
    finally:
        started.set()
        told.put((noise.answers, noise.failure))


async def _noise(
    url: str, token: str, drip_url: str, stacks_job: int, noise: Noise, started: Flag, stop: Flag
) -> None:
    limits = httpx.Limits(max_connections=FLOOD + UPLOADS + 4)
    async with httpx.AsyncClient(base_url=url, headers=bearer(token), timeout=90, limits=limits) as client:
        for _ in range(SUBSCRIPTIONS_TRIED):
            hook = {"url": drip_url, "on": ["running", "ended"]}
            noise.record("subscriptions", await client.post(SUBSCRIPTIONS, json=hook))
        await _code_jobs(client, noise)
        for n in range(STALLING):
            body = {
                **DEAF_JOB,
                "name": f"stalling-{n}",
                "watchdog": {"stall_after_s": 15, "on_stall": "fail"},
                "restarts": {"max": 0},  # ended, as before restarts in place
            }
            noise.record("stalling jobs", await client.post(JOBS, json=body))
        started.set()
        await asyncio.gather(
            *(_stacks(client, stacks_job, noise, stop) for _ in range(FLOOD)),
            *(_upload(client, noise) for _ in range(UPLOADS)),
        )


async def _code_jobs(client: httpx.AsyncClient, noise: Noise) -> None:
    upload = await client.post(
        "/api/v1/code", content=_archive({"weights.bin": bytes(UNPACKED_BYTES)}), headers=_GZIP
    )
    assert upload.status_code in (200, 201), upload.text
    code = upload.json()["id"]
    for n in range(CODE_JOBS):
        body = {**DEAF_JOB, "name": f"large-{n}", "code": code, "script": "tiny.py"}
        noise.record("code jobs", await client.post(JOBS, json=body))


async def _stacks(client: httpx.AsyncClient, job_id: int, noise: Noise, stop: Flag) -> None:
    while not stop.is_set():
        answer = noise.record("stacks", await client.get(f"{JOBS}/{job_id}/stacks"))
        if answer.status >= 400:
            await asyncio.sleep(_pause(answer))


async def _upload(client: httpx.AsyncClient, noise: Noise) -> None:
    response = await client.post(
        "/api/v1/code", content=_archive({"noise.bin": os.urandom(UPLOAD_BYTES)}), headers=_GZIP
    )
    noise.record("uploads", response)


def _pause(answer: Answer) -> float:
    try:
        return min(MAX_PAUSE_S, max(0.2, float(answer.retry_after or 1)))
    except ValueError:
        return 1.0


_GZIP = {"Content-Type": "application/gzip"}


def _archive(files: dict[str, bytes]) -> bytes:
    """A .tar.gz of tiny.py (it prints and exits) and `files`."""
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w:gz") as tar:
        for name, data in {"tiny.py": b"print('done')\n", **files}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return packed.getvalue()
