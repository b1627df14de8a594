"""Who you are to the service (`whoami`) and who did what (`audit`, admin tokens only)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from service.cli.context import connect, make_console


def whoami(ctx: typer.Context) -> None:
    """Who the service takes you for (the user of your token)."""
    with connect(ctx) as client:
        me = client.whoami()
    make_console().print(f"{me['user']}" + (" (admin)" if me["admin"] else ""))


def audit(
    ctx: typer.Context,
    actor: Annotated[str | None, typer.Option(help="Only what this user did.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500, help="How many, newest first.")] = 50,
) -> None:
    """The audit log: who submitted, cancelled, created or revoked what (admin tokens only)."""
    with connect(ctx) as client:
        entries = client.audit(actor=actor, limit=limit)
    for entry in entries:
        detail = f"  {entry['detail']}" if entry.get("detail") else ""
        line = f"{entry['time'][:19]}  {entry['actor']:<16} {entry['action']:<13} {entry['target']}{detail}"
        make_console().print(escape(line), soft_wrap=True)
