"""NCCL's flight recorder on a real GPU: a rank with worker.stacks' defaults runs collectives, is sent
SIGURG, and the dump it writes after the capture parses (service.domain.stacks) with its last
collective's sequence number. One GPU: NCCL world size 1, in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from service.domain.stacks import parse_faulthandler, parse_flight_recorder  # noqa: E402
from tests.support import ROOT  # noqa: E402
from worker.spec import JobFiles  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

RANK = """\
import os, signal, sys, time
from datetime import timedelta
from pathlib import Path
from worker.spec import JobFiles
from worker.stacks import dump_flight_recorder_on_capture, flight_recorder_env, install_stack_dumps
files = JobFiles(Path(sys.argv[1]))
install_stack_dumps(files, 0, 1, "gpu-host")
flight_recorder_env(files, os.environ)  # before torch, as the launcher does
dump_flight_recorder_on_capture(files, 0)
import torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=f"file://{sys.argv[2]}", rank=0, world_size=1,
                        timeout=timedelta(seconds=60), device_id=torch.device("cuda", 0))
tensor = torch.ones(1024, device="cuda")
for _ in range(3):
    dist.all_reduce(tensor)
torch.cuda.synchronize()
os.kill(os.getpid(), signal.SIGURG)
deadline = time.monotonic() + 20
while not files.flight_recorder(0).exists() and time.monotonic() < deadline:
    time.sleep(0.1)
dist.destroy_process_group()
print("dumped" if files.flight_recorder(0).exists() else "no dump", flush=True)
"""


def test_a_capture_brings_the_nccl_flight_recorder_dump(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK))
    job = tmp_path / "job"
    done = subprocess.run([sys.executable, str(script), str(job), str(tmp_path / "store")], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=240, check=False)  # fmt: skip
    assert done.returncode == 0 and "dumped" in done.stdout, done.stderr[-3000:]
    files = JobFiles(job)
    assert parse_faulthandler(files.stacks(0).read_text())
    record = parse_flight_recorder(files.flight_recorder(0).read_bytes())
    assert record is not None, files.flight_recorder(0).read_bytes()[:200]
    (last,) = record.groups.values()
    assert last.seq >= 3 and "all_reduce" in last.op, record
