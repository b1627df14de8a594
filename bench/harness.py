"""Shared bench plumbing: free ports, servers in subprocesses, wrk runs parsed into numbers.

Every load is loopback only and bounded in time.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from service.states import TERMINAL_STATE_NAMES

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def server(module_app: str, env: dict[str, str] | None = None, ready_path: str = "/healthz") -> Iterator[str]:
    """Run `uvicorn module:app` (one worker) on a free loopback port; yield its base URL."""
    port = free_port()
    cmd = ["-m", "uvicorn", module_app, "--factory", "--host", "127.0.0.1", "--port", str(port)]
    with _serving([*cmd, "--log-level", "warning", "--no-access-log"], port, env, ready_path) as url:
        yield url


@contextmanager
def _serving(args: list[str], port: int, env: dict[str, str] | None, ready_path: str) -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + ready_path, timeout=1).status_code < 500:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{args} did not start")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


# Benches measure the service, not its quotas: a user may submit as fast as the load allows. The
# bench's user has no Unix account of its own, so its jobs run as the service's (as a service that is
# not root runs every job); starting a process through setpriv instead is one exec more per job.
BENCH_SETTINGS = {
    "TORCHYARD_MAX_SUBMISSIONS_PER_MINUTE": str(10**9),
    "TORCHYARD_MAX_ACTIVE_JOBS_PER_USER": str(10**9),
    "TORCHYARD_JOB_ACCOUNTS": "service",
}


def make_token(env: dict[str, str], user: str = "bench") -> str:
    """A real API token, made as an operator makes one: `torchyard token create` on the same ledger."""
    command = [str(Path(sys.executable).parent / "torchyard"), "token", "create", "--user", user]
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"token create failed: {done.stderr}")
    return done.stdout.strip().splitlines()[-1]


@contextmanager
def torchyard(module_app: str, env: dict[str, str]) -> Iterator[tuple[str, dict[str, str]]]:
    """The service as users meet it (tokens checked, every request authenticated, served as
    `torchyard serve` serves it: bench.serve): (url, headers)."""
    env = {**BENCH_SETTINGS, **env}
    headers = {"Authorization": f"Bearer {make_token(env)}"}
    port = free_port()
    with _serving(["-m", "bench.serve", module_app, str(port)], port, env, "/healthz") as url:
        yield url, headers


@dataclass
class WrkResult:
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    requests: int

    def line(self, label: str) -> str:
        return (
            f"{label:<44} {self.requests_per_s:9.0f} req/s   p50 {self.p50_ms:7.1f} ms   "
            f"p99 {self.p99_ms:7.1f} ms   non-2xx/3xx {self.non_2xx}"
        )


def wrk(
    url: str, *, connections: int, seconds: int, script: str | None = None, threads: int = 2
) -> WrkResult:
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is needed: apt-get install -y wrk")
    cmd = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--latency", "--timeout", "10s"]
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as handle:
        if script:
            handle.write(script)
            cmd += ["-s", handle.name]
    out = subprocess.run([*cmd, url], capture_output=True, text=True, check=True).stdout
    os.unlink(handle.name)
    return parse_wrk(out)


def _ms(text: str) -> float:
    value, unit = re.match(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def parse_wrk(out: str) -> WrkResult:
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    # Anchored to the "Latency Distribution" lines: a stdev column such as "90.50%" also ends in "50%".
    p50 = _ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return WrkResult(rps, p50, p99, int(bad.group(1)) if bad else 0, total)


def _lua(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def header_script(headers: dict[str, str] | None) -> str:
    return "".join(f'wrk.headers["{_lua(k)}"] = "{_lua(v)}"\n' for k, v in (headers or {}).items())


def post_script(body: str, headers: dict[str, str] | None = None) -> str:
    return (
        f'wrk.method = "POST"\nwrk.body = "{_lua(body)}"\nwrk.headers["Content-Type"] = "application/json"\n'
        + header_script(headers)
    )




def time_job(client: httpx.Client, body: dict[str, object]) -> float:
    """Seconds from POST to the job seen succeeded; exits if it did not check out."""
    started = time.perf_counter()
    run_job(client, body)
    return time.perf_counter() - started


def run_job(client: httpx.Client, body: dict[str, object]) -> dict[str, Any]:
    """POST `body` and return the job once it succeeded; exits if it did not check out.

    It waits the way `TorchyardClient.wait` does, with long polls (the service answers when the job
    changes), so the client neither adds a polling interval nor loads the service while ranks run.
    """
    created = client.post("/api/v1/jobs", json=body).raise_for_status()
    job, tag = created.json(), ""
    while job["state"] not in TERMINAL_STATE_NAMES:
        answer = client.get(f"/api/v1/jobs/{job['id']}", params={"wait_s": 20},
                            headers={"If-None-Match": tag} if tag else None)
        if answer.status_code != 304:  # 304: nothing changed in the long poll's 20 s (httpx raises on it)
            answer.raise_for_status()
            job, tag = answer.json(), answer.headers["ETag"]
    if job["state"] != "succeeded" or not job["result"]["ok"]:
        raise SystemExit(f"torchyard job did not check out: {job['state']} {job['reason']}")
    finished: dict[str, Any] = job
    return finished


def post_many(url: str, path: str, body: dict[str, Any], headers: dict[str, str], count: int,
              connections: int = 32) -> float:
    """POST `body` exactly `count` times over `connections` keep-alive connections; seconds taken.

    A lean HTTP/1.1 client on asyncio streams: a Python client with a full HTTP library per request
    tops out below what the service accepts, and the benchmark must measure the service, not its
    client. Every answer must be 2xx.
    """
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payload = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
            f"Content-Length: {len(payload)}", *(f"{name}: {value}" for name, value in headers.items())]
    request = ("\r\n".join(head) + "\r\n\r\n").encode() + payload
    left = count

    async def one_connection() -> None:
        nonlocal left
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while left > 0:
                left -= 1
                writer.write(request)
                status = int((await reader.readline()).split()[1])
                length = 0
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                answer = await reader.readexactly(length)
                if not 200 <= status < 300:
                    raise SystemExit(f"POST {path} answered {status}: {answer[:300]!r}")
        finally:
            writer.close()

    async def run_all() -> None:
        await asyncio.gather(*(one_connection() for _ in range(connections)))

    started = time.perf_counter()
    asyncio.run(run_all())
    return time.perf_counter() - started
