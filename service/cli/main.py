"""The `torchyard` command: serve the API, submit and watch jobs, read logs, run the demo.

Every command but `serve` and `demo` is a thin layer over service.client, so it works against any
torchyard service (TORCHYARD_URL / --url). Heavy imports (FastAPI, SQLModel, uvicorn) happen only in
the commands that start a service, which keeps `torchyard list` quick.

Exit codes: 0 done (for submit --wait: the job succeeded); 1 the job did not succeed, or the demo's
checks failed; 2 the request was refused or the service could not be reached; 130 interrupted.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress

from service.cli.admin import code_app, folders, gc, quota_app, token_app
from service.cli.logs import STREAMS, print_logs
from service.cli.progress import watch_jobs
from service.cli.render import Job, as_json, job_details, jobs_table, state_text
from service.cli.sweep_view import sweep_view, sweeps_table, watch_sweep
from service.client import TorchyardClient, TorchyardError
from service.states import TERMINAL_STATE_NAMES
from worker.spec import CODE_ID_PREFIX

EXIT_JOB_FAILED = 1
EXIT_REQUEST = 2
EXIT_INTERRUPTED = 130

app = typer.Typer(
    name="torchyard",
    help="Launch PyTorch distributed training jobs on this machine or a SLURM cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,  # a bug should print a plain traceback, not a page of locals
)
app.add_typer(token_app, name="token")
app.add_typer(quota_app, name="quota")
app.command()(gc)
app.command()(folders)
app.add_typer(code_app, name="code")


@dataclass
class Connection:
    url: str | None
    token: str | None


PIPE_WIDTH = 160  # off a terminal nobody resizes: wide enough that tables need not cut cells


def _console(stderr: bool = False) -> Console:
    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPE_WIDTH
    return console


def _fail(message: str, code: int) -> typer.Exit:
    _console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    return typer.Exit(code)


@contextmanager
def _client(ctx: typer.Context) -> Iterator[TorchyardClient]:
    """A client for the command; the service's refusals become one readable line and exit code 2."""
    connection = ctx.obj if isinstance(ctx.obj, Connection) else Connection(None, None)
    try:
        with TorchyardClient(connection.url, token=connection.token) as client:
            yield client
    except TorchyardError as error:
        raise _fail(str(error), EXIT_REQUEST) from None


@app.callback()
def _root(
    ctx: typer.Context,
    url: Annotated[
        str | None,
        typer.Option(
            envvar="TORCHYARD_URL", help="The service's address.", show_default="http://127.0.0.1:8321"
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="TORCHYARD_TOKEN", help="API token (else ~/.config/torchyard/token).", show_default=False
        ),
    ] = None,
) -> None:
    ctx.obj = Connection(url, token)


# ---------------------------------------------------------------- the service


@app.command()
def serve(
    host: Annotated[
        str | None, typer.Option(help="Interface to listen on.", show_default="TORCHYARD_HOST, 127.0.0.1")
    ] = None,
    port: Annotated[int | None, typer.Option(help="Port.", show_default="TORCHYARD_PORT, 8321")] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
    dev: Annotated[
        bool, typer.Option("--dev", help="No tokens: every caller is admin. Only on 127.0.0.1.")
    ] = False,
) -> None:
    """Run the service (API, dispatch and reconcile loops) in the foreground until Ctrl-C.

    Callers need a token (`torchyard token create`) unless --dev (or TORCHYARD_DEV_MODE=true).
    """
    from service.app import create_app
    from service.config import Settings
    from service.serving import serve as serve_app

    overrides: dict[str, Any] = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
    if dev:
        overrides["dev_mode"] = True
    try:
        settings = Settings(**overrides)  # TORCHYARD_* from the environment; the flags win
    except ValueError as error:  # pydantic's ValidationError: name the setting, no traceback
        raise _fail(f"bad TORCHYARD_* setting: {error}", EXIT_REQUEST) from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    base = f"http://{settings.host}:{settings.port}"
    _console().print(f"torchyard on {base}  (API docs {base}/docs, data in {settings.data_dir.resolve()})")
    try:
        application = create_app(settings)
    except ValueError as error:
        raise _fail(str(error), EXIT_REQUEST) from None
    serve_app(application, settings, host=settings.host, port=settings.port, log_level=log_level.lower())


@app.command()
def demo(
    serve: Annotated[bool, typer.Option("--serve", help="Keep the service running afterwards.")] = False,
    port: Annotated[
        int | None, typer.Option(help="Port.", show_default="8321, or a free one if taken")
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(help="Ledger and job folders.", show_default="TORCHYARD_DATA_DIR, ./.torchyard"),
    ] = None,
) -> None:
    """Start the service, run the two seed demonstrations through its REST API, check their results."""
    from service.cli.demo import run_demo

    raise typer.Exit(run_demo(_console(), port=port, data_dir=data_dir, keep_serving=serve))


# ---------------------------------------------------------------- jobs


def load_spec(
    path: Path, code: Path | None = None, what: str = "name, entrypoint or script, ..."
) -> dict[str, Any]:
    """A job spec (or a sweep's, whose `job` is one) from YAML or JSON. A `code` that is not a
    snapshot id is a folder, taken relative to the spec file's folder (`code: .` is the spec's own),
    which `submit` packs and uploads; a relative `script` is then a file of that code. Without code, a
    relative `script` is taken relative to the spec file's folder, so a spec next to its script works
    from any directory (the service needs an absolute path). `code` (submit --code) replaces the
    spec's own."""
    try:
        text = path.read_text()
        spec = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as error:
        raise _fail(f"cannot read {path}: {error}", EXIT_REQUEST) from None
    if not isinstance(spec, dict):
        raise _fail(f"{path} must hold one mapping ({what})", EXIT_REQUEST)
    if code is not None:
        spec["code"] = str(code.resolve())
    for job in (spec, spec.get("job")):  # a sweep's job is a job spec too
        if not isinstance(job, dict):
            continue
        code_field, script = job.get("code"), job.get("script")
        if isinstance(code_field, str) and not code_field.startswith(CODE_ID_PREFIX):
            job["code"] = str((path.parent / code_field).resolve())
        elif code_field is None and isinstance(script, str) and script and not Path(script).is_absolute():
            job["script"] = str((path.parent / script).resolve())
    return spec


PROGRESS_FROM_BYTES = 4 * 2**20  # smaller uploads take a moment: no bar


def upload_code(client: TorchyardClient, folder: Path) -> str:
    """Pack and upload `folder` (only when the service lacks it), with a progress bar when it is large."""
    if not folder.is_dir():
        raise _fail(f"code: {folder} is not a folder", EXIT_REQUEST)
    with Progress(transient=True, console=_console(stderr=True)) as bar:
        task = bar.add_task(f"uploading {folder.name or folder}", total=None, visible=False)

        def advance(sent: int, total: int) -> None:
            bar.update(task, completed=sent, total=total, visible=total >= PROGRESS_FROM_BYTES)

        code_id = client.upload_code(folder, progress=advance)
    _console(stderr=True).print(f"code {folder} is {code_id}", soft_wrap=True, markup=False)
    return code_id


def _upload_code_folder(client: TorchyardClient, job: dict[str, Any]) -> None:
    """A job spec's `code` that names a folder (load_spec made it absolute): packed, uploaded unless
    the service has it, and replaced by its id."""
    if isinstance(job.get("code"), str) and not job["code"].startswith(CODE_ID_PREFIX):
        job["code"] = upload_code(client, Path(job["code"]))


def outcome(job: Job) -> int:
    """Print how a finished job ended; the exit code says whether it succeeded."""
    console = _console()
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


@app.command()
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
    """Submit a job described by FILE."""
    spec = load_spec(file, code)
    with _client(ctx) as client:
        _upload_code_folder(client, spec)
        job = client.submit(spec)
        _console().print(f"submitted job {job['id']} ({job['name']}), {job['state']}")
        if not wait:
            return
        try:
            final = watch_jobs(client, [job], _console(), poll_s=poll)[job["id"]]
        except KeyboardInterrupt:
            raise _fail(
                f"stopped watching; job {job['id']} goes on (torchyard cancel {job['id']} stops it)",
                EXIT_INTERRUPTED,
            ) from None
    raise typer.Exit(outcome(final))


@app.command("list")
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
    with _client(ctx) as client:
        page = client.list(state=state, name=name, limit=limit)
    if as_json_flag:
        typer.echo(as_json(page))
        return
    if not page["items"]:
        _console().print("no jobs" + (" match" if state or name else " yet: torchyard submit FILE"))
        return
    console = _console()
    console.print(jobs_table(page["items"], width=console.width))
    if page.get("next_cursor"):
        _console().print(f"[dim]newest {limit} shown; --limit for more[/]")


@app.command()
def show(
    ctx: typer.Context,
    job_id: Annotated[int, typer.Argument(metavar="ID")],
    as_json_flag: Annotated[bool, typer.Option("--json", help="Print the API's JSON.")] = False,
) -> None:
    """One job: state, reason, where it runs, progress, result, its attempts and its history."""
    with _client(ctx) as client:
        job = client.get(job_id)
        events = client.events(job_id)
        attempts = client.attempts(job_id) if int(job.get("attempt", 1)) > 1 else []
    if as_json_flag:
        typer.echo(as_json(job))
        return
    _console().print(job_details(job, events, attempts))


@app.command()
def cancel(ctx: typer.Context, job_id: Annotated[int, typer.Argument(metavar="ID")]) -> None:
    """Cancel a job (in any state; a finished job stays as it is)."""
    with _client(ctx) as client:
        job = client.cancel(job_id)
    state = str(job["state"])
    if state == "cancelled":
        _console().print(f"job {job_id} cancelled")
    elif job.get("cancel_requested") and state not in TERMINAL_STATE_NAMES:
        _console().print(f"job {job_id}: cancel requested, it is {state} now")
    else:
        _console().print(f"job {job_id} had already ended: {state}")


@app.command()
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
        raise _fail("--stream must be out, err or both", EXIT_REQUEST)
    streams = STREAMS if stream == "both" else (stream,)
    with _client(ctx) as client:
        try:
            print_logs(client, job_id, rank, streams, tail=tail, follow=follow)
        except KeyboardInterrupt:
            raise typer.Exit(EXIT_INTERRUPTED) from None


# ---------------------------------------------------------------- sweeps


@app.command()
def sweep(
    ctx: typer.Context,
    target: Annotated[
        str, typer.Argument(metavar="SPEC|show|cancel", help="A sweep spec file (YAML or JSON), or a verb.")
    ],
    sweep_id: Annotated[
        int | None, typer.Argument(metavar="[ID]", help="The sweep, for show and cancel.")
    ] = None,
    wait: Annotated[
        bool, typer.Option("--wait", help="Watch the trials to the end; exit 0 only if all succeed.")
    ] = False,
    as_json_flag: Annotated[bool, typer.Option("--json", help="Print the API's JSON.")] = False,
) -> None:
    """Launch a sweep (`torchyard sweep spec.yaml`), or `show ID` / `cancel ID` one.

    A sweep spec: name, job (a job spec without its name), grid (parameter -> values; every
    combination is a trial), zip, max_parallel, metric and goal. Trials are ordinary jobs."""
    console = _console()
    with _client(ctx) as client:
        if target in ("show", "cancel"):
            if sweep_id is None:
                raise _fail(f"torchyard sweep {target} needs the sweep's ID", EXIT_REQUEST)
            found = client.sweep(sweep_id) if target == "show" else client.cancel_sweep(sweep_id)
        else:
            path = Path(target)
            if sweep_id is not None or not path.is_file():
                raise _fail(
                    f"{target} is no sweep spec file (or use: sweep show ID, sweep cancel ID)", EXIT_REQUEST
                )
            sweep_spec = load_spec(path, what="name, job, grid, ...")
            if isinstance(sweep_spec.get("job"), dict):
                _upload_code_folder(client, sweep_spec["job"])
            found = client.submit_sweep(sweep_spec)
            if not as_json_flag:
                console.print(f"submitted sweep {found['id']} ({found['name']}): {found['size']} trials")
        if wait:
            try:
                found = watch_sweep(client, found["id"], console)
            except KeyboardInterrupt:
                raise _fail(
                    f"stopped watching; sweep {found['id']} goes on "
                    f"(torchyard sweep cancel {found['id']} stops it)",
                    EXIT_INTERRUPTED,
                ) from None
    if as_json_flag:
        typer.echo(as_json(found))
    elif not wait:
        console.print(sweep_view(found))
    if wait and set(found["counts"]) != {"succeeded"}:
        raise typer.Exit(EXIT_JOB_FAILED)


@app.command()
def sweeps(
    ctx: typer.Context,
    limit: Annotated[int, typer.Option(min=1, max=200, help="How many, newest first.")] = 20,
    as_json_flag: Annotated[bool, typer.Option("--json", help="Print the API's JSON.")] = False,
) -> None:
    """List sweeps, newest first, with their trial counts and best trial."""
    with _client(ctx) as client:
        page = client.sweeps(limit=limit)
    if as_json_flag:
        typer.echo(as_json(page))
    elif not page["items"]:
        _console().print("no sweeps yet: torchyard sweep FILE")
    else:
        _console().print(sweeps_table(page["items"]))


@app.command()
def whoami(ctx: typer.Context) -> None:
    """Who the service takes you for (the user of your token)."""
    with _client(ctx) as client:
        me = client.whoami()
    _console().print(f"{me['user']}" + (" (admin)" if me["admin"] else ""))


@app.command()
def audit(
    ctx: typer.Context,
    actor: Annotated[str | None, typer.Option(help="Only what this user did.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500, help="How many, newest first.")] = 50,
) -> None:
    """The audit log: who submitted, cancelled, created or revoked what (admin tokens only)."""
    with _client(ctx) as client:
        entries = client.audit(actor=actor, limit=limit)
    for entry in entries:
        detail = f"  {entry['detail']}" if entry.get("detail") else ""
        line = f"{entry['time'][:19]}  {entry['actor']:<16} {entry['action']:<13} {entry['target']}{detail}"
        _console().print(escape(line), soft_wrap=True)


def main() -> None:
    app()
