"""`torchyard stacks ID` against an httpx.MockTransport: the capture as grouped text (the odd rank
first, each group's host and frames, the notes), --last asks for the kept capture, --json prints the
API's JSON, and a 409 exits 2 with the service's words. Markup in what a rank wrote stays text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

import service.cli.context as cli_context
from service.cli.context import EXIT_REQUEST
from service.cli.main import app
from service.client import TorchyardClient


def thread(*frames: tuple[str, int, str]) -> dict[str, Any]:
    return {"name": "0x00007f3b938d2040", "current": True, "truncated": False,
            "frames": [{"file": f, "line": n, "function": fn} for f, n, fn in frames]}  # fmt: skip


STUCK = thread(("/job/loader.py", 41, "[bold]next_batch[/bold]"), ("/job/train.py", 30, "main"))
WAITING = thread(("/torch/distributed/c10d.py", 2501, "all_reduce"), ("/job/train.py", 88, "step"))
CAPTURE = {
    "job_id": 7, "attempt": 1, "captured_at": "2026-12-06T21:40:00Z", "trigger": "request", "took_s": 0.19,
    "summary": "rank 1 on n2 in loader.py:41 [bold]next_batch[/bold]; ranks 0, 2 on n1 wait in all_reduce",
    "groups": [{"ranks": [1], "label": "1", "threads": [STUCK], "note": None},
               {"ranks": [0, 2], "label": "0, 2", "threads": [WAITING], "note": None}],
    "ranks": [{"rank": 0, "host": "n1", "threads": [WAITING], "note": None},
              {"rank": 1, "host": "n2", "threads": [STUCK], "note": None},
              {"rank": 2, "host": "n1", "threads": [WAITING], "note": "wrote 1073741824 bytes"}],
    "fresh": True,
}  # fmt: skip


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[httpx.Request]]:
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        if request.url.path == "/api/v1/jobs/7/stacks":
            return httpx.Response(200, json=CAPTURE)
        detail = [{"loc": ["job_id"], "msg": "job_id: job 8 has no stacks captured, and it is not running"}]
        return httpx.Response(409, json={"detail": detail})

    transport = httpx.MockTransport(handler)
    real = TorchyardClient

    def client(base_url: str | None = None, token: str | None = None, **kwargs: Any) -> TorchyardClient:
        return real("http://mock", token=token, transport=transport)

    monkeypatch.setattr(cli_context, "TorchyardClient", client)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    yield requests


def test_stacks_print_the_groups_odd_rank_first(asked: list[httpx.Request]) -> None:
    result = CliRunner().invoke(app, ["stacks", "7"])

    assert result.exit_code == 0, result.output
    out = result.output
    assert "job 7, attempt 1: captured now" in out and "0.19 s" in out
    assert "rank 1 on n2:" in out and "ranks 0, 2 on n1:" in out
    assert out.index("rank 1 on n2:") < out.index("ranks 0, 2 on n1:")
    assert "/job/loader.py:41 [bold]next_batch[/bold]" in out  # as the rank wrote it, not styled
    assert "rank 2: wrote 1073741824 bytes" in out
    assert "capture" not in asked[0].url.params


def test_last_json_and_a_conflict(asked: list[httpx.Request]) -> None:
    runner = CliRunner()
    shown = runner.invoke(app, ["stacks", "7", "--last", "--json"])
    refused = runner.invoke(app, ["stacks", "8"])

    assert json.loads(shown.output)["summary"] == CAPTURE["summary"]
    assert asked[0].url.params["capture"] == "false"
    assert refused.exit_code == EXIT_REQUEST and "no stacks captured" in refused.output
