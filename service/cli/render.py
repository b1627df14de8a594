"""How the CLI draws jobs: state colours, the jobs table, one job's details. Plain dicts in, rich out."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.pretty import Pretty
from rich.table import Table
from rich.text import Text

Job = dict[str, Any]

STATE_STYLE = {
    "waiting": "dim cyan",
    "queued": "dim",
    "submitted": "cyan",
    "pending": "yellow",
    "running": "bold blue",
    "succeeded": "bold green",
    "failed": "bold red",
    "cancelled": "magenta",
    "timeout": "bold red",
    "preempted": "yellow",
    "requeued": "yellow",
    "retrying": "yellow",
}
STALLED_STYLE = "bold red"


def owner(job: dict[str, Any]) -> str:
    """The user, and the Unix account the job runs as where that is another name."""
    user, account = str(job.get("owner", "")), job.get("run_as")
    return user if not account or account == user else f"{user} (runs as {account})"


def state_text(state: str, stalled: bool = False) -> Text:
    """The state in its colour; a running job the watchdog flagged says so ("running, stalled")."""
    text = Text(state, style=STATE_STYLE.get(state, ""))
    if stalled:
        text.append(", stalled", style=STALLED_STYLE)
    return text


def stalled_text(job: Job, now: datetime | None = None) -> str:
    """"since 2026-... (4 min)" for a job flagged stalled, else ""."""
    since = parse_time(job.get("stalled_at"))
    if since is None:
        return ""
    lasted = ((now or datetime.now(timezone.utc)) - since).total_seconds()
    return f"since {job['stalled_at']} ({human_seconds(lasted)})"


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def human_seconds(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours < 48 else f"{hours // 24}d{hours % 24:02d}h"


WAITING = ("pending", "requeued")  # in the scheduler's queue: it may have a start estimate


def start_estimate(job: Job, now: datetime | None = None) -> str:
    """"starts in about 12 min, reason: Resources" for a job the scheduler has an estimate for, else ""."""
    expected = parse_time(job.get("expected_start_at"))
    if job.get("state") not in WAITING or expected is None:
        return ""
    minutes = round(((expected - (now or datetime.now(timezone.utc))).total_seconds()) / 60)
    if minutes < 1:
        when = "starts any moment"
    elif minutes < 120:
        when = f"starts in about {minutes} min"
    else:
        when = f"starts in about {human_seconds(minutes * 60)}"
    return f"{when}, reason: {job['reason']}" if job.get("reason") else when


def age(job: Job, now: datetime | None = None) -> str:
    created = parse_time(job.get("created_at"))
    if created is None:
        return ""
    return human_seconds(((now or datetime.now(timezone.utc)) - created).total_seconds())


def duration(job: Job) -> str:
    """Run time: started -> finished (or -> now while it runs); empty before it starts."""
    started = parse_time(job.get("started_at")) or parse_time(job.get("submitted_at"))
    if started is None:
        return ""
    finished = parse_time(job.get("finished_at")) or datetime.now(timezone.utc)
    return human_seconds((finished - started).total_seconds())


def ranks(job: Job) -> str:
    resources = (job.get("spec") or {}).get("resources") or {}
    return f"{resources.get('nodes', 1)}x{resources.get('tasks_per_node', 1)}"


def format_metric(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def progress_text(job: Job, metrics: int = 2) -> str:
    """'step 40/100 loss 0.1234' from the job's latest progress line; '' before the first one."""
    progress = job.get("progress") or {}
    if progress.get("step") is None:
        return ""
    total = progress.get("total")
    parts = [f"step {progress['step']}" + (f"/{total}" if total else "")]
    values = progress.get("metrics") or {}
    # loss first: it is what a person watching training looks for
    names = sorted(values, key=lambda name: (name != "loss", name))[:metrics]
    parts += [f"{name} {format_metric(values[name])}" for name in names]
    return " ".join(parts)


def first_line(text: str | None, width: int = 60) -> str:
    if not text:
        return ""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    line = lines[-1] if lines else ""  # a traceback's last line says what broke
    return line if len(line) <= width else line[: width - 1] + "…"


def jobs_table(jobs: list[Job], width: int = 80) -> Table:
    """One row per job; the reason column gets what is left of `width` (`show ID` prints it whole)."""
    headers = ("ID", "NAME", "STATE", "BACKEND", "RANKS", "PROGRESS", "AGE", "RAN")
    rows = [
        (
            str(job["id"]),
            str(job.get("name", "")),
            str(job.get("state", "")),
            str(job.get("backend", "")),
            ranks(job),
            progress_text(job, metrics=1),
            age(job),
            duration(job),
        )
        for job in jobs
    ]
    used = sum(max([len(h), *(len(row[i]) for row in rows)]) + 3 for i, h in enumerate(headers))
    table = Table(show_edge=False, header_style="bold", padding=(0, 1), pad_edge=False)
    for header in headers:
        table.add_column(header, no_wrap=True, justify="right" if header == "ID" else "left")
    table.add_column("REASON", overflow="ellipsis", no_wrap=True, max_width=max(8, width - used))
    for job, row in zip(jobs, rows, strict=True):
        # A succeeded job's reason ("completed") says nothing the state does not.
        reason = "" if row[2] == "succeeded" else start_estimate(job) or first_line(job.get("reason"))
        if job.get("stalled_at"):
            reason = first_line(job.get("stall_reason"))
        state = state_text(row[2], stalled=bool(job.get("stalled_at")))
        table.add_row(*(escape(cell) for cell in row[:2]), state, *row[3:], escape(reason))
    return table


def job_details(
    job: Job, events: list[Job] | None = None, attempts: list[Job] | None = None
) -> RenderableType:
    """Everything a person asks about one job, top to bottom: what, where, how it went, its attempts
    (when there was more than one), history."""
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column()
    target = (job.get("spec") or {}).get("entrypoint") or (job.get("spec") or {}).get("script")
    rows: list[tuple[str, RenderableType]] = [
        ("job", Text(f"{job['id']}  {job.get('name', '')}")),
        ("state", state_text(str(job.get("state")), stalled=bool(job.get("stalled_at")))),
        ("runs", Text(f"{target}  on {ranks(job)} ranks, backend {job.get('backend')}")),
        ("owner", Text(owner(job))),
        ("attempt", Text(attempt_text(job))),
        ("nodes", Text(str(job.get("nodes") or "-"))),
        ("ranks", Text(placement_text(job.get("placement")) or "-")),
        ("external id", Text(str(job.get("external_id") or "-"))),
        ("folder", Text(str(job.get("folder") or "-"))),
        ("created", Text(f"{job.get('created_at')} ({age(job)} ago)")),
        ("ran", Text(duration(job) or "-")),
        ("progress", Text(progress_text(job, metrics=5) or "-")),
    ]
    if estimate := start_estimate(job):
        rows.append(("queue", Text(estimate)))
    if restarts := restarts_text(job):
        rows.append(("restarts", Text(restarts)))
    if kept := goodput_text(job):
        rows.append(("goodput", Text(kept)))
    if stalled := stalled_text(job):
        rows.append(("stalled", Text(stalled, style=STALLED_STYLE)))
    if job.get("exit_code") is not None:
        rows.append(("exit code", Text(str(job["exit_code"]))))
    if job.get("latest_checkpoint"):
        rows.append(("checkpoint", Text(str(job["latest_checkpoint"]))))
    for label, value in rows:
        facts.add_row(label, value)
    parts: list[RenderableType] = [facts]
    # Long text below the facts, unwrapped into a column: a traceback reads best at full width.
    if job.get("stall_reason"):  # which rank is where: read before the reason
        parts += [Text("\nstalled", style=STALLED_STYLE), Text(str(job["stall_reason"]).strip())]
    if job.get("reason"):
        parts += [Text("\nreason", style="bold"), Text(str(job["reason"]).strip())]
    if job.get("result") is not None:
        parts += [Text("\nresult", style="bold"), Pretty(job["result"])]
    if attempts:
        table = Table(title="attempts", title_justify="left", show_edge=False, header_style="bold")
        for column in ("#", "ENDED AS", "WHY", "NODES", "ID", "ENDED", "REASON"):
            table.add_column(column)
        for one in attempts:
            table.add_row(
                str(one.get("attempt")),
                state_text(str(one.get("state", ""))),
                str(one.get("kind") or ""),
                escape(str(one.get("nodes") or "")),
                escape(str(one.get("external_id") or "")),
                str(one.get("ended_at") or ""),
                escape(str(one.get("reason") or "").strip().split("\n", 1)[0][:80]),  # who, where
            )
        parts += [Text(""), table]
    if not events:
        return Group(*parts)
    history = Table(title="history", title_justify="left", show_edge=False, header_style="bold")
    for column in ("TIME", "FROM", "TO", "REASON"):
        history.add_column(column)
    for event in events:
        history.add_row(
            str(event.get("time", "")),
            str(event.get("from_state") or ""),
            state_text(str(event.get("to_state", ""))),
            escape(first_line(event.get("reason"), 80)),
        )
    return Group(*parts, Text(""), history)


def placement_text(placement: list[dict[str, Any]] | None) -> str:
    """Ranks by host, e.g. "0-3 on n1 (GPUs 0,1,2,3); 4-7 on n2", in rank order."""
    by_host: dict[str, list[dict[str, Any]]] = {}
    for placed in placement or []:
        by_host.setdefault(str(placed.get("host")), []).append(placed)
    parts = []
    for host, ranks in by_host.items():
        numbers = [int(placed["rank"]) for placed in ranks]
        span = (
            f"{numbers[0]}-{numbers[-1]}"
            if numbers == list(range(numbers[0], numbers[-1] + 1)) and len(numbers) > 1
            else ",".join(map(str, numbers))
        )
        gpus = [str(placed["gpu"]) for placed in ranks if placed.get("gpu") is not None]
        parts.append(f"{span} on {host}" + (f" (GPUs {','.join(gpus)})" if gpus else ""))
    return "; ".join(parts)


def attempt_text(job: Job) -> str:
    """ "2", or "2 of at most 3" under a retry policy, with when a retry waiting its backoff goes out."""
    attempt = int(job.get("attempt", 1))
    policy = job.get("retries") or {}
    text = f"{attempt} of at most {1 + int(policy['max'])}" if policy.get("max") else str(attempt)
    if job.get("state") == "retrying" and job.get("retry_at"):
        text += f", goes out at {job['retry_at']}"
    return text


def restarts_text(job: Job) -> str:
    """ "1 in place (at most 2 an attempt, on node_failure, hang)"; empty when none and none allowed."""
    policy = job.get("restarts") or {}
    count = int(job.get("restart_count") or 0)
    if not count and not policy.get("max"):
        return ""
    on = ", ".join(policy.get("on") or [])
    return f"{count} in place (at most {policy.get('max', 0)} an attempt, on {on or 'nothing'})"


GOODPUT_PARTS = ("training", "downtime", "recomputed", "queue")


def goodput_parts(job: Job, now: datetime | None = None) -> dict[str, float]:
    """The job's goodput seconds by part, the part it accrues brought up to `now` (the service works
    it out at each change: service.domain.goodput)."""
    goodput = job.get("goodput") or {}
    parts = {part: float(goodput.get(f"{part}_s") or 0.0) for part in GOODPUT_PARTS}
    as_of, accruing = parse_time(goodput.get("as_of")), goodput.get("accruing")
    if as_of is not None and accruing in parts:
        parts[accruing] += max(0.0, ((now or datetime.now(timezone.utc)) - as_of).total_seconds())
    return parts


def goodput_text(job: Job, now: datetime | None = None) -> str:
    """ "92% training: training 1h02m, restart downtime 12.0s, recomputed 40.0s, queue 3m10s"."""
    if not (job.get("goodput") or {}).get("as_of"):  # not worked out yet (a job from before goodput)
        return ""
    parts = goodput_parts(job, now)
    wall = sum(parts.values())
    share = f"{100 * parts['training'] / wall:.0f}% training: " if wall > 0 else ""
    named = {"downtime": "restart downtime"}
    return share + ", ".join(f"{named.get(part, part)} {human_seconds(sec)}" for part, sec in parts.items())


def as_json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True)
