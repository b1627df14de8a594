"""`torchyard token list` and `token revoke` through the API: your own tokens (an admin's: every
user's), wherever you are. With --ledger the same verbs work straight on the ledger on the service
host (service.cli.admin), for an operator with no token to call the API with."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from service.cli.context import connect, make_console


def list_own(ctx: typer.Context, include_revoked: bool) -> None:
    with connect(ctx) as client:
        rows = client.tokens(include_revoked=include_revoked)
    table = Table("id", "user", "admin", "unix user", "via", "starts with", "created", "expires", "revoked")
    for row in rows:
        table.add_row(
            str(row["id"]),
            row["username"],
            "yes" if row["admin"] else "",
            row["unix_user"] or "",
            row["via"] or "",
            row["prefix"],
            _when(row["created_at"]),
            _when(row["expires_at"]),
            _when(row["revoked_at"]),
        )
    make_console().print(table)


def revoke_own(ctx: typer.Context, token_id: int) -> None:
    with connect(ctx) as client:
        row = client.revoke_token(token_id)
    typer.echo(f"token {token_id} of {row['username']} revoked")


def _when(value: Any) -> str:
    return str(value)[:19] if value else ""
