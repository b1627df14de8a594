"""The job verbs: `submit`, `list`, `show`, `cancel` and `logs`, each a thin layer over service.client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from service.cli.context import EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_REQUEST, connect, fail, make_console
from service.cli.logs import STREAMS, print_logs
from service.cli.pipelines import is_pipeline, submit_pipeline
from service.cli.progress import watch_jobs
from service.cli.render import Job, as_json, job_details, jobs_table, state_text
from service.cli.specs import load_spec, upload_code_folder
from service.states import TERMINAL_STATE_NAMES


def outcome(job: Job) -> int:
    """Print how a finished job ended; the exit code says whether it succeeded."""
    console = make_console()
    state = str(job["state"])
    header = state_text(state)
    header.append(f"  job {job['id']} {job['name']}", style="")
    console.print(header)
    if state == "succeeded":
        if job.get("result") is not None:
            console.print_json(json.dumps(job["result"]))
        return 0
    reason = (job.get("reason") or "no reason recorded").strip()
    console.print(f"reason: {reason}", markup=False)
    if job.get("exit_code") is not None:
        console.print(f"exit code: {job['exit_code']}")
    console.print(f"logs: torchyard logs {job['id']} --rank 0", markup=False)
    return EXIT_JOB_FAILED


def submit(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="Job spec, YAML or JSON.")],
    wait: Annotated[
        bool, typer.Option("--wait", help="Watch it to the end; exit 0 only if it succeeds.")
    ] = False,
    poll: Annotated[float, typer.Option(help="Seconds between status reads while waiting.")] = 0.5,
    code: Annotated[
        Path | None,
        typer.Option(
            "--code",
            file_okay=False,
            help="A project folder the job runs in: packed (honouring .gitignore and .torchyardignore; "
            "no .git, .venv, __pycache__), uploaded unless the service has it, named as the job's code.",
        ),
    ] = None,
) -> None:
    """Submit a job described by FILE (or a pipeline: a file with top-level `stages`)."""
    spec = load_spec(file, code)
    with connect(ctx) as client:
        if is_pipeline(spec):
            submit_pipeline(client, spec, wait, poll)
            return
        upload_code_folder(client, spec)
        job = client.submit(spec)
        make_console().print(f"submitted job {job['id']} ({job['name']}), {job['state']}")
        if not wait:
            return
        try:
            final = watch_jobs(client, [job], make_console(), poll_s=poll)[job["id"]]
        except KeyboardInterrupt:
            raise fail(
                f"stopped watching; job {job['id']} goes on (torchyard cancel {job['id']} stops it)",
                EXIT_INTERRUPTED,
            ) from None
    raise typer.Exit(outcome(final))


def list_jobs(
    ctx: typer.Context,
    state: Annotated[list[str] | None, typer.Option(help="Only this state (repeat for several).")] = None,
    name: Annotated[
        str | None, typer.Option(help="Only names containing this (3+ characters; A-Z and a-z alike).")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=500, help="How many, newest first.")] = 20,
    as_json_flag: Annotated[bool, typer.Option("--json", help="Print the API's JSON.")] = False,
) -> None:
    """List jobs, newest first."""
    with connect(ctx) as client:
        page = client.list(state=state, name=name, limit=limit)
    if as_json_flag:
        typer.echo(as_json(page))
        return
    if not page["items"]:
        make_console().print("no jobs" + (" match" if state or name else " yet: torchyard submit FILE"))
        return
    console = make_console()
    console.print(jobs_table(page["items"], width=console.width))
    if page.get("next_cursor"):
        make_console().print(f"[dim]newest {limit} shown; --limit for more[/]")


def show(
    ctx: typer.Context,
    job_id: Annotated[int, typer.Argument(metavar="ID")],
    as_json_flag: Annotated[bool, typer.Option("--json", help="Print the API's JSON.")] = False,
) -> None:
    """One job: state, reason, where it runs, progress, result, its attempts and its history."""
    with connect(ctx) as client:
        job = client.get(job_id)
        events = client.events(job_id)
        attempts = client.attempts(job_id) if int(job.get("attempt", 1)) > 1 else []
    if as_json_flag:
        typer.echo(as_json(job))
        return
    make_console().print(job_details(job, events, attempts))


def cancel(ctx: typer.Context, job_id: Annotated[int, typer.Argument(metavar="ID")]) -> None:
    """Cancel a job (in any state; a finished job stays as it is)."""
    with connect(ctx) as client:
        job = client.cancel(job_id)
    state = str(job["state"])
    if state == "cancelled":
        make_console().print(f"job {job_id} cancelled")
    elif job.get("cancel_requested") and state not in TERMINAL_STATE_NAMES:
        make_console().print(f"job {job_id}: cancel requested, it is {state} now")
    else:
        make_console().print(f"job {job_id} had already ended: {state}")


def logs(
    ctx: typer.Context,
    job_id: Annotated[int, typer.Argument(metavar="ID")],
    rank: Annotated[int, typer.Option(min=0, help="Which rank's log.")] = 0,
    tail: Annotated[int | None, typer.Option(min=0, help="Only the last N lines.")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")] = False,
    stream: Annotated[str, typer.Option(help="out, err or both.")] = "both",
) -> None:
    """Print a rank's log: its stdout to stdout, its stderr (log lines, tracebacks) to stderr."""
    if stream not in (*STREAMS, "both"):
        raise fail("--stream must be out, err or both", EXIT_REQUEST)
    streams = STREAMS if stream == "both" else (stream,)
    with connect(ctx) as client:
        try:
            print_logs(client, job_id, rank, streams, tail=tail, follow=follow)
        except KeyboardInterrupt:
            raise typer.Exit(EXIT_INTERRUPTED) from None
