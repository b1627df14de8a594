"""A process that is the service (service.serving.serve, what `torchyard serve` runs): its start-up
heap is frozen out of garbage collection once it serves, and Ctrl-C still stops it at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.cli_service import clean_env
from tests.serving import free_port
from tests.support import ROOT

# The real app, runtime and loops, plus one route that reports this process's frozen heap.
# SIGINT as a terminal's foreground process has it, even when the tests run as a background job (a
# shell starts those with SIGINT ignored; uvicorn then re-raises the signal it caught into nothing).
SERVE = """
import gc, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from service.app import create_app
from service.config import Settings
from service.serving import serve

settings = Settings(dev_mode=True, port=int(sys.argv[1]))
app = create_app(settings)
app.add_api_route("/frozen", lambda: {"objects": gc.get_freeze_count()})
serve(app, settings, host="127.0.0.1", port=settings.port, log_level="warning")
"""


def test_a_serving_process_freezes_its_start_up_heap_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    port = free_port()
    env = clean_env(TORCHYARD_DATA_DIR=str(tmp_path / "data"))
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-c", SERVE, str(port)], cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT
        )
    try:
        frozen = None
        deadline = time.monotonic() + 60
        while frozen is None and process.poll() is None and time.monotonic() < deadline:
            try:
                frozen = httpx.get(f"http://127.0.0.1:{port}/frozen", timeout=2).json()["objects"]
            except httpx.HTTPError:
                time.sleep(0.1)
        assert frozen is not None, log.read_text()
        assert frozen > 50_000, frozen  # modules, the app and the runtime: ~130k objects measured
        assert httpx.get(f"http://127.0.0.1:{port}/api/v1/jobs", timeout=5).status_code == 200

        process.send_signal(signal.SIGINT)
        # uvicorn shuts down, then raises the signal it caught again: the process ends as Ctrl-C ends it
        assert process.wait(timeout=30) == -signal.SIGINT, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
