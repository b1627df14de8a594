"""`torchyard notify`: webhook subscriptions (add, list, rm) and their deliveries."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from service.cli.context import EXIT_REQUEST, connect, fail, make_console
from service.cli.render import as_json, first_line

notify_app = typer.Typer(help="Webhooks told when jobs or pipelines reach a state.", no_args_is_help=True)

ON_HELP = "Comma-separated states: failed, succeeded, cancelled, timeout, running, ... or ended (any ending)."
JsonFlag = Annotated[bool, typer.Option("--json", help="Print the API's JSON.")]


@notify_app.command("add")
def add(
    ctx: typer.Context,
    url: Annotated[str, typer.Argument(help="An http(s) URL on a host the operator allows.")],
    on: Annotated[str, typer.Option(help=ON_HELP)] = "ended",
    job: Annotated[int | None, typer.Option(min=1, help="Only this job.")] = None,
    pipeline: Annotated[int | None, typer.Option(min=1, help="Only this pipeline (and its jobs).")] = None,
    secret: Annotated[
        str | None, typer.Option(help="The HMAC key (16+ characters); by default the service makes one.")
    ] = None,
    as_json_flag: JsonFlag = False,
) -> None:
    """Subscribe URL: a signed JSON POST (with a `text` line for Slack or Mattermost) each time one of
    your jobs (or only --job / --pipeline) reaches a state in --on."""
    if job is not None and pipeline is not None:
        raise fail("give --job or --pipeline, not both", EXIT_REQUEST)
    states = [one.strip() for one in on.split(",") if one.strip()]
    with connect(ctx) as client:
        made = client.subscribe(url, states, job=job, pipeline=pipeline, secret=secret)
    if as_json_flag:
        typer.echo(as_json(made))
        return
    console = make_console()
    told = ", ".join(made["on"])
    console.print(f"subscription {made['id']}: {escape(made['url'])} on {told}", soft_wrap=True)
    console.print(f"secret: {made['secret']}", soft_wrap=True)
    console.print(
        "each POST carries X-Torchyard-Signature: sha256=<HMAC-SHA256 of its body with this secret>"
    )


@notify_app.command("list")
def list_subscriptions(ctx: typer.Context, as_json_flag: JsonFlag = False) -> None:
    """Your subscriptions (GET /api/v1/notifications/subscriptions/ID shows one's secret)."""
    with connect(ctx) as client:
        rows = client.subscriptions()
    if as_json_flag:
        typer.echo(as_json(rows))
        return
    if not rows:
        make_console().print("no subscriptions: torchyard notify add URL --on failed,succeeded")
        return
    table = _table("id", "url", "on", "for", "created")
    for row in rows:
        scope = "all yours"
        if row["job_id"] is not None or row["pipeline_id"] is not None:
            scope = _of(row)
        table.add_row(str(row["id"]), escape(row["url"]), ",".join(row["on"]), scope, row["created_at"][:19])
    make_console().print(table)


@notify_app.command("rm")
def remove(ctx: typer.Context, subscription_id: Annotated[int, typer.Argument(metavar="ID", min=1)]) -> None:
    """Remove a subscription; its deliveries not yet sent fail."""
    with connect(ctx) as client:
        client.unsubscribe(subscription_id)
    make_console().print(f"removed subscription {subscription_id}")


@notify_app.command("deliveries")
def deliveries(
    ctx: typer.Context,
    job: Annotated[int | None, typer.Option(min=1, help="Of this job.")] = None,
    pipeline: Annotated[int | None, typer.Option(min=1, help="Of this pipeline.")] = None,
    status: Annotated[str | None, typer.Option(help="pending, delivered or failed.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500, help="How many, newest first.")] = 50,
    as_json_flag: JsonFlag = False,
) -> None:
    """Your webhook deliveries, newest first: what was sent where, how many tries, the last error."""
    with connect(ctx) as client:
        rows = client.deliveries(job=job, pipeline=pipeline, status=status, limit=limit)
    if as_json_flag:
        typer.echo(as_json(rows))
        return
    table = _table("id", "event", "of", "status", "tries", "last error", "url")
    for row in rows:
        table.add_row(str(row["id"]), row["event"], _of(row), row["status"], str(row["attempts"]),
                      escape(first_line(row["last_error"], 50)), escape(row["url"]))  # fmt: skip
    make_console().print(table)


def _of(row: dict[str, Any]) -> str:
    return f"job {row['job_id']}" if row["job_id"] is not None else f"pipeline {row['pipeline_id']}"


def _table(*columns: str) -> Table:
    table = Table(show_edge=False, header_style="bold", padding=(0, 1), pad_edge=False)
    for column in columns:
        table.add_column(column)
    return table
