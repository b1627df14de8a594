"""The `torchyard` command: serve the API, submit and watch jobs, read logs, run the demo.

Every command but `serve` and `demo` is a thin layer over service.client, so it works against any
torchyard service (TORCHYARD_URL / --url). Heavy imports (FastAPI, SQLModel, uvicorn) happen only in
the commands that start a service, which keeps `torchyard list` quick.

Exit codes: 0 done (for submit --wait: the job succeeded); 1 the job did not succeed, or the demo's
checks failed; 2 the request was refused or the service could not be reached; 130 interrupted.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

import typer

from service.cli.access import audit, whoami
from service.cli.admin import code_app, folders, gc, quota_app, token_app
from service.cli.context import EXIT_REQUEST, Connection, fail, make_console
from service.cli.jobs import cancel, list_jobs, logs, show, submit
from service.cli.login import login
from service.cli.notify import notify_app
from service.cli.pipelines import pipeline_app
from service.cli.stacks import stacks
from service.cli.sweeps import sweep, sweeps

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
app.add_typer(notify_app, name="notify")
app.add_typer(pipeline_app, name="pipeline")


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
        raise fail(f"bad TORCHYARD_* setting: {error}", EXIT_REQUEST) from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    base = f"http://{settings.host}:{settings.port}"
    make_console().print(
        f"torchyard on {base}  (API docs {base}/docs, data in {settings.data_dir.resolve()})"
    )
    try:
        application = create_app(settings)
    except ValueError as error:
        raise fail(str(error), EXIT_REQUEST) from None
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

    raise typer.Exit(run_demo(make_console(), port=port, data_dir=data_dir, keep_serving=serve))


# The verbs of the other modules, in the order `torchyard --help` lists them.
app.command()(submit)
app.command("list")(list_jobs)
app.command()(show)
app.command()(cancel)
app.command()(logs)
app.command()(stacks)
app.command()(sweep)
app.command()(sweeps)
app.command()(whoami)
app.command()(login)
app.command()(audit)


def main() -> None:
    app()
