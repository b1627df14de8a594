"""`torchyard stacks ID`: every rank's stacks, grouped (ranks with the same stack together, the odd
ones first), as plain text. What a rank wrote is printed as text, never as console markup."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from service.cli.context import connect
from service.cli.render import as_json

MAX_FRAMES = 30  # of one thread, innermost first: the rest is in --json


def stacks(
    ctx: typer.Context,
    job_id: Annotated[int, typer.Argument(metavar="ID")],
    last: Annotated[
        bool, typer.Option("--last", help="Show the last capture kept; capture nothing now.")
    ] = False,
    as_json_flag: Annotated[bool, typer.Option("--json", help="Print the API's JSON.")] = False,
) -> None:
    """Every rank's stacks: captured now from a running job, else the last capture kept."""
    with connect(ctx) as client:
        capture = client.stacks(job_id, capture=False if last else None)
    typer.echo(as_json(capture) if as_json_flag else render_capture(capture))


def render_capture(capture: dict[str, Any]) -> str:
    """The capture as people read it: a header, the summary, each group's stacks, each rank's note."""
    when = str(capture.get("captured_at", ""))
    made = "captured now" if capture.get("fresh") else "last capture"
    lines = [
        f"job {capture.get('job_id')}, attempt {capture.get('attempt')}: {made} at {when} "
        f"({capture.get('trigger')}, {float(capture.get('took_s') or 0):.2f} s)",
        str(capture.get("summary") or ""),
    ]
    hosts = {one.get("rank"): one.get("host") for one in capture.get("ranks", [])}
    for group in capture.get("groups", []):
        ranks = group.get("ranks", [])
        where = sorted({str(hosts.get(rank)) for rank in ranks if hosts.get(rank)})
        label = "rank" if len(ranks) == 1 else "ranks"
        lines += ["", f"{label} {group.get('label')}" + (f" on {', '.join(where)}" if where else "") + ":"]
        for thread in group.get("threads", []):
            lines += _thread_lines(thread)
    notes = [one for one in capture.get("ranks", []) if one.get("note")]
    if notes:
        lines += ["", "notes:"] + [f"  rank {one.get('rank')}: {one.get('note')}" for one in notes]
    return "\n".join(lines)


def _thread_lines(thread: dict[str, Any]) -> list[str]:
    current = " (current)" if thread.get("current") else ""
    lines = [f"  thread {thread.get('name')}{current}, most recent call first:"]
    frames = thread.get("frames", [])
    for frame in frames[:MAX_FRAMES]:
        lines.append(f"    {frame.get('file')}:{frame.get('line')} {frame.get('function')}")
    if len(frames) > MAX_FRAMES:
        lines.append(f"    ... {len(frames) - MAX_FRAMES} more (--json)")
    return lines
