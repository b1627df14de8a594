"""`torchyard logs`: print one rank's logs, and with --follow keep printing what is appended.

A rank's stdout goes to our stdout and its stderr to our stderr (as `docker logs` does): the worker's
log lines and tracebacks are on stderr, a script's prints on stdout, and pipes keep them apart.
The API serves a log's tail, so following polls a window of recent lines and prints only the part
after what was already shown (the files only grow).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from service.client import TorchyardClient
from service.states import TERMINAL_STATE_NAMES

WINDOW_LINES = 2000  # lines fetched per poll while following
STREAMS = ("out", "err")


def new_part(before: list[str], window: list[str]) -> tuple[list[str], bool]:
    """The lines of `window` that come after those of `before`, the previous window of the same log.

    The log only grows, so the new window is the old one shifted up by some lines with new lines
    below; the smallest shift that lines the two up is the right one (a log shorter than a window
    never shifts). bool: whether they overlapped; if not, more was appended than a window holds.
    """
    for shift in range(len(before) + 1):
        overlap = len(before) - shift
        if window[:overlap] == before[shift:]:
            return window[overlap:], overlap > 0 or not before
    return window, False  # pragma: no cover - shift == len(before) always matches


class LogFollower:
    """One stream's last window of complete lines; a partial last line waits for its newline."""

    def __init__(self, client: TorchyardClient, job_id: int, rank: int, stream: str, sink: TextIO) -> None:
        self._client, self._job_id, self._rank, self._stream = client, job_id, rank, stream
        self._sink = sink
        self._shown: list[str] = []

    def poll(self, final: bool = False, first_tail: int | None = None) -> None:
        """Print what is new. On the first poll, first_tail limits how much of the past is shown."""
        text = self._client.logs(self._job_id, rank=self._rank, tail=WINDOW_LINES, stream=self._stream)
        lines = text.splitlines(keepends=True)
        if lines and not lines[-1].endswith("\n") and not final:
            lines = lines[:-1]  # the rank is mid-line: print it whole, next time
        fresh, overlapped = new_part(self._shown, lines)
        if not overlapped:
            self._sink.write("... (earlier lines skipped)\n")
        shown_now = fresh if first_tail is None else fresh[-first_tail:] if first_tail > 0 else []
        self._sink.writelines(shown_now)
        self._sink.flush()
        self._shown = lines


def print_logs(
    client: TorchyardClient,
    job_id: int,
    rank: int,
    streams: tuple[str, ...],
    tail: int | None = None,
    follow: bool = False,
    poll_s: float = 1.0,
) -> None:
    sinks = {"out": sys.stdout, "err": sys.stderr}
    followers = [LogFollower(client, job_id, rank, stream, sinks[stream]) for stream in streams]
    if not follow:
        for stream in streams:
            text = client.logs(job_id, rank=rank, tail=tail, stream=stream)
            sinks[stream].write(text)
            sinks[stream].flush()
        return
    for follower in followers:
        follower.poll(first_tail=tail)
    while client.get(job_id)["state"] not in TERMINAL_STATE_NAMES:
        time.sleep(poll_s)
        for follower in followers:
            follower.poll()
    for follower in followers:  # what the ranks wrote last, partial line included
        follower.poll(final=True)
