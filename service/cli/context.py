"""What every verb of the `torchyard` command shares: the connection the root callback keeps (the
service's address and token), the consoles it prints on, the exit codes and the one way a verb fails."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import typer
from rich.console import Console
from rich.markup import escape

from service.client import TorchyardClient, TorchyardError

EXIT_JOB_FAILED = 1
EXIT_REQUEST = 2
EXIT_INTERRUPTED = 130


@dataclass
class Connection:
    url: str | None
    token: str | None


PIPE_WIDTH = 160  # off a terminal nobody resizes: wide enough that tables need not cut cells


def make_console(stderr: bool = False) -> Console:
    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPE_WIDTH
    return console


def fail(message: str, code: int) -> typer.Exit:
    make_console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    return typer.Exit(code)


@contextmanager
def connect(ctx: typer.Context) -> Iterator[TorchyardClient]:
    """A client for the command; the service's refusals become one readable line and exit code 2."""
    connection = ctx.obj if isinstance(ctx.obj, Connection) else Connection(None, None)
    try:
        with TorchyardClient(connection.url, token=connection.token) as client:
            yield client
    except TorchyardError as error:
        raise fail(str(error), EXIT_REQUEST) from None
