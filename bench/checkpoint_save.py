"""Training blocked by one checkpoint of a ~100M-parameter model: ctx.save_checkpoint (a copy in
memory, written in the background) against a synchronous torch.save of the same state to the same
folder, alternated in the same run, several rounds. Target: <= 0.1x.

Also shown, per round: the synchronous save the context did before (wait=True: torch.save, fsync,
rename, note), how long the background write took to finish, and a training step's time while that
write runs against the same step with the disk quiet (the write shares the process's cores).

Run (the machine is shared: under the heavy lock): .venv/bin/python -m bench.checkpoint_save [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from worker.context import JobContext
from worker.distributed import RankEnv
from worker.spec import RunSpec

WIDTH, LAYERS = 4096, 6  # 6 x (4096 x 4096 + 4096) = 100.7M parameters, 403 MB in float32


def context(folder: Path) -> JobContext:
    fields = {"job_id": 1, "name": "bench-ckpt", "entrypoint": "m:f", "folder": str(folder),
              "checkpoints": {"keep_last": 1}}  # fmt: skip
    spec = RunSpec.model_validate(fields)
    return JobContext(spec, RankEnv(0, 1, 0, 1, 0, "127.0.0.1", 29500, "local", "1"))


def step(model: torch.nn.Module, batch: torch.Tensor) -> float:
    """One forward and backward pass, timed (what training does between saves)."""
    started = time.perf_counter()
    model(batch).sum().backward()
    return time.perf_counter() - started


def one_round(model: torch.nn.Module, folder: Path, n: int) -> dict[str, float]:
    state = {"model": model.state_dict(), "step": n}
    batch = torch.randn(8, WIDTH)
    quiet = statistics.median(step(model, batch) for _ in range(3))

    started = time.perf_counter()
    torch.save(state, folder / "plain.pt")  # the baseline: what a loop calling torch.save waits for
    plain = time.perf_counter() - started

    ctx = context(folder)  # a fresh context: its first save allocates the copy's buffers
    started = time.perf_counter()
    ctx.save_checkpoint(state, 3 * n)
    first = time.perf_counter() - started
    ctx.close()

    started = time.perf_counter()
    ctx.save_checkpoint(state, 3 * n + 1)  # the buffers of the first reused
    blocked = time.perf_counter() - started
    busy = [step(model, batch) for _ in range(3)]  # while the write runs
    ctx.close()  # waits for the write
    written = time.perf_counter() - started

    started = time.perf_counter()
    ctx.save_checkpoint(state, 3 * n + 2, wait=True)
    synchronous = time.perf_counter() - started
    ctx.close()
    return {"plain": plain, "sync": synchronous, "first": first, "blocked": blocked, "written": written,
            "step_quiet": quiet, "step_busy": statistics.median(busy)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--folder", type=Path, default=None, help="where to write (default: a temp folder)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(dir=args.folder) as tmp:
        folder = Path(tmp)
        print(f"model: {params / 1e6:.1f}M parameters, {params * 4 / 2**20:.0f} MiB; writing to {folder}")
        rounds: list[dict[str, Any]] = []
        for n in range(args.rounds):
            rounds.append(one_round(model, folder, n))
            r = rounds[-1]
            print(f"round {n + 1}: torch.save {r['plain']:.3f} s   wait=True {r['sync']:.3f} s   "
                  f"background: first save blocked {r['first'] * 1000:.0f} ms, "
                  f"next {r['blocked'] * 1000:.0f} ms "
                  f"(written in {r['written']:.2f} s)   step {r['step_quiet'] * 1000:.0f} ms quiet, "
                  f"{r['step_busy'] * 1000:.0f} ms while writing")
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    print(f"median: torch.save {median['plain']:.3f} s; wait=True (torch.save, fsync, rename, note) "
          f"{median['sync']:.3f} s = {median['sync'] / median['plain']:.2f}x")
    print(f"first save of a context (buffers allocated): blocked {median['first'] * 1000:.0f} ms = "
          f"{median['first'] / median['plain']:.3f}x torch.save")
    paired = statistics.median(r["blocked"] / r["plain"] for r in rounds)  # each round against its own
    print(f"later saves (buffers reused): blocked {median['blocked'] * 1000:.0f} ms = "
          f"{median['blocked'] / median['plain']:.3f}x torch.save; round by round, median "
          f"{paired:.3f}x (target <= 0.1x)")
    print(f"a step while the write runs: {median['step_busy'] / median['step_quiet']:.2f}x a quiet one")


if __name__ == "__main__":
    main()
