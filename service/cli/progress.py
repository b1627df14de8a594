"""Watching jobs until they end: a rich progress bar per job on a terminal, plain lines elsewhere.

The bar is driven by the job's latest progress line (step/total and metrics, as rank 0 reported it)
and its state. Off a terminal (CI logs, pipes, tests) a live display would print nothing until the
end, so the same information is written as one line per change instead.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from service.cli.render import STALLED_STYLE, STATE_STYLE, Job, first_line, progress_text
from service.client import TorchyardClient
from service.states import TERMINAL_STATE_NAMES

LINE_EVERY_S = 2.0  # plain mode: at most one progress line per job this often (state changes always)


class _View(Protocol):
    def update(self, job: Job) -> None: ...
    def __enter__(self) -> _View: ...
    def __exit__(self, *exc: object) -> None: ...


def bar_position(job: Job) -> tuple[float, float | None]:
    """(completed, total) for the bar: a finished job's bar is full even if it never reported."""
    progress = job.get("progress") or {}
    step, total = progress.get("step"), progress.get("total")
    if job.get("state") == "succeeded":
        full = float(total or step or 1)
        return full, full
    if step is None:
        return 0.0, None  # no total yet: rich draws a pulsing bar
    return float(step), float(total) if total else None


class _BarView:
    def __init__(self, console: Console, jobs: Sequence[Job]) -> None:
        self._progress = Progress(
            SpinnerColumn(finished_text="•"),
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=30),
            TextColumn("{task.fields[state]}"),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            console=console,
            refresh_per_second=8,
        )
        self._tasks: dict[int, TaskID] = {
            job["id"]: self._progress.add_task(f"{job['id']} {job['name']}", total=None, state="", detail="")
            for job in jobs
        }

    def update(self, job: Job) -> None:
        completed, total = bar_position(job)
        state = str(job["state"])
        style = STATE_STYLE.get(state, "")
        shown = f"[{style}]{state}[/]" if style else state
        if job.get("stalled_at"):  # the watchdog's flag (service.loops.watch)
            shown += f", [{STALLED_STYLE}]stalled[/]"
        self._progress.update(
            self._tasks[job["id"]],
            completed=completed,
            total=total,
            state=shown,
            detail=progress_text(job),
        )
        if state in TERMINAL_STATE_NAMES:
            self._progress.stop_task(self._tasks[job["id"]])  # freezes its elapsed time

    def __enter__(self) -> _BarView:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()


class _LineView:
    def __init__(self, console: Console) -> None:
        self._console = console
        self._last: dict[int, tuple[str, str, float]] = {}

    def update(self, job: Job) -> None:
        state, detail, now = str(job["state"]), progress_text(job), time.monotonic()
        if job.get("stalled_at"):
            state += f", stalled: {first_line(job.get('stall_reason'), 200)}"
        before = self._last.get(job["id"])
        if before is not None:
            changed_state = before[0] != state
            if not changed_state and (before[1] == detail or now - before[2] < LINE_EVERY_S):
                return
        self._last[job["id"]] = (state, detail, now)
        line = f"job {job['id']} {job['name']}: {state}" + (f"  {detail}" if detail else "")
        self._console.print(line, markup=False, highlight=False)

    def __enter__(self) -> _LineView:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def carry_progress(previous: Job | None, job: Job) -> Job:
    """The job with the total and metrics of its previous progress kept where the latest line has none.

    Not every progress line repeats them (a checkpoint line carries only its step), and a bar that
    falls back to pulsing, or a loss that blinks out, between two reports would mislead.
    """
    progress = dict(job.get("progress") or {})
    before = (previous or {}).get("progress") or {}
    if not before:
        return job
    if not progress:
        return {**job, "progress": before}
    for key in ("total", "metrics"):
        if progress.get(key) is None and before.get(key) is not None:
            progress[key] = before[key]
    return {**job, "progress": progress}


def watch_jobs(
    client: TorchyardClient, jobs: Sequence[Job], console: Console, poll_s: float = 0.5
) -> dict[int, Job]:
    """Watch every job until all are terminal, showing their progress; returns the final jobs by id.

    Several jobs are polled every poll_s; the last one left is followed with long polls, so its
    end is shown as soon as it is committed.
    """
    final: dict[int, Job] = {}
    latest: dict[int, Job] = {}
    view: _View = _BarView(console, jobs) if console.is_terminal else _LineView(console)

    def show(job: Job) -> Job:
        current = carry_progress(latest.get(job["id"]), job)
        latest[job["id"]] = current
        view.update(current)
        return current

    with view:
        while True:
            pending = [job for job in jobs if job["id"] not in final]
            if len(pending) == 1:
                last = client.wait(pending[0]["id"], on_update=show, poll_s=poll_s)
                final[last["id"]] = latest[last["id"]]
                return final
            for job in pending:
                current = show(client.get(job["id"]))
                if current["state"] in TERMINAL_STATE_NAMES:
                    final[job["id"]] = current
            if len(final) == len(jobs):
                return final
            time.sleep(poll_s)
