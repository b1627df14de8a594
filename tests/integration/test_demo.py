"""`torchyard demo` for real: its own service on a free port, the two seed jobs over REST, checked.

The demo runs in a subprocess through the CLI's main(), with a final line saying whether torch was
imported in that process: the service (the demo's parent) must never import it, only the ranks do.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.cli_service import clean_env
from tests.serving import free_port
from tests.support import ROOT

pytestmark = pytest.mark.integration

# The demo is stopped with Ctrl-C: SIGINT as a terminal's foreground process has it, even when the
# tests run as a background job (a shell starts those with SIGINT ignored, and children inherit it).
RUN_DEMO = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from service.cli.main import main
try:
    main()
finally:
    print("torch imported by the demo process:", "torch" in sys.modules)
"""


def test_demo_checks_both_demonstrations_then_keeps_serving(tmp_path: Path) -> None:
    port = free_port()
    data = tmp_path / "yard"
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    demo = subprocess.Popen(
        [sys.executable, "-c", RUN_DEMO, "demo", "--serve", "--port", str(port), "--data-dir", str(data)],
        cwd=tmp_path,  # not the repository: the demo must not depend on files next to it
        env=clean_env(NO_COLOR="1", PYTHONUNBUFFERED="1", XDG_CONFIG_HOME=str(tmp_path / "config")),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    watchdog = threading.Timer(240, demo.kill)  # a hung demo fails the test instead of hanging it
    watchdog.start()
    try:
        assert demo.stdout is not None
        lines = []
        for line in demo.stdout:
            lines.append(line)
            if "Ctrl-C stops it" in line:
                break
        wall = time.monotonic() - started
        served = httpx.get(f"{url}/api/v1/jobs", timeout=10).json()["items"]  # --serve: still there
        demo.send_signal(signal.SIGINT)
        lines += demo.stdout.read().splitlines(keepends=True)
        code = demo.wait(timeout=60)
    finally:
        watchdog.cancel()
        demo.kill()
    out = "".join(lines)
    assert code == 0, out
    assert sorted((job["name"], job["state"]) for job in served) == [
        ("demo-ddp-parameters", "succeeded"),
        ("demo-sampler-shards", "succeeded"),
    ]
    assert f"service on {url}" in out
    assert str(data.resolve()) in out  # where the data went is said
    assert "submitted over REST: job 1 demo-ddp-parameters, job 2 demo-sampler-shards" in out
    for rank in range(4):  # the sampler's table: rank r -> samples [r, r+4]
        assert re.search(rf"^ {rank} +│ \[{rank}, {rank + 4}\] +│ \[{rank}, {rank + 4}\] +│ ✓", out, re.M), (
            out
        )
    assert "✓ after the step, all ranks hold identical parameters" in out
    assert "✓ every rank built the same seeded dataset" in out
    assert "both demonstrations check out" in out
    assert f"API docs:  {url}/docs" in out
    assert "torch imported by the demo process: False" in out
    assert (data / "torchyard.db").exists() and (data / "jobs" / "1").is_dir()
    print(f"demo wall time to checked results: {wall:.1f}s")


def test_demo_refuses_a_taken_port_clearly(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-c", RUN_DEMO, "demo", "--port", str(port), "--data-dir", str(tmp_path)],
            cwd=ROOT,
            env=clean_env(NO_COLOR="1"),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in done.stdout and "--port" in done.stdout
