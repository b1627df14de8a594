"""`torchyard token ...`, `torchyard quota ...`, `torchyard gc` and `torchyard folders`: run on the
service host, straight on the ledger (and, for gc, the data directory). `token list` and `token
revoke` go through the API (service.cli.tokens) unless --ledger says otherwise.

They read the same TORCHYARD_* settings as `torchyard serve` (the database URL above all), so the
first admin token can be made before anyone can call the API: that is the bootstrap.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from service.cli import tokens

if TYPE_CHECKING:  # the ledger is imported by the verbs that use it, not by the CLI at start
    from sqlalchemy.engine import Engine
    from sqlmodel import Session

    from service.config import Settings

token_app = typer.Typer(
    help="Create API tokens (on the service host); list and revoke yours.", no_args_is_help=True
)
quota_app = typer.Typer(help="Per-user limits (on the service host).", no_args_is_help=True)
EXIT_REFUSED = 2


class Switch(str, Enum):
    """An explicit yes or no (a flag could not say "back to no")."""

    true = "true"
    false = "false"


@contextmanager
def _ledger() -> Iterator[Session]:
    from service.ledger.db import session_scope

    with _service() as (_, engine), session_scope(engine) as session:
        yield session


@contextmanager
def _service() -> Iterator[tuple[Settings, Engine]]:
    """The service's settings and its migrated ledger; a ServiceError ends the verb with its message."""
    from service.config import Settings
    from service.errors import ServiceError
    from service.ledger.db import make_engine, migrate

    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(settings.resolved_database_url())
    try:
        migrate(engine)
        yield settings, engine
    except ServiceError as error:
        where = f"{error.field}: " if error.field else ""
        Console(stderr=True).print(f"[bold red]error:[/] {where}{error.message}", soft_wrap=True)
        raise typer.Exit(EXIT_REFUSED) from None
    finally:
        engine.dispose()


@token_app.command("create")
def token_create(
    user: Annotated[str, typer.Option(help="Whose token: jobs submitted with it belong to this user.")],
    admin: Annotated[bool, typer.Option("--admin", help="May see and cancel every user's jobs.")] = False,
    unix_user: Annotated[
        str | None,
        typer.Option(help="The Unix account this user's jobs run as (default: the account of their name)."),
    ] = None,
    allow_code: Annotated[
        bool, typer.Option("--allow-code", help="May upload and run their own code (code snapshots).")
    ] = False,
    save: Annotated[
        bool, typer.Option("--save", help="Also write it where this machine's CLI and client look (0600).")
    ] = False,
) -> None:
    """Make a token and print it, alone, on the last line. It is shown only this once."""
    from service.accounts import check_mapping
    from service.client import save_token
    from service.domain import auth
    from service.ledger.db import session_scope

    with _service() as (settings, engine):
        if unix_user is not None:
            check_mapping(unix_user, settings)
        with session_scope(engine) as session:
            raw = auth.create_token(
                session, user, admin=admin, unix_user=unix_user, allow_code=allow_code, actor="cli"
            )
    kind = "admin token" if admin else "token"
    if save:
        typer.echo(f"saved to {save_token(raw)}")
    typer.echo(f"new {kind} for {user} (stored only as a hash: copy it now):")
    typer.echo(raw)


LEDGER_HELP = "On the service host: straight on the ledger, every user's, without a token or the API."


@token_app.command("list")
def token_list(
    ctx: typer.Context,
    all_: Annotated[bool, typer.Option("--all", help="Include revoked tokens.")] = False,
    ledger: Annotated[bool, typer.Option("--ledger", help=LEDGER_HELP)] = False,
) -> None:
    """Your tokens (an admin's: every user's) by id, user and first characters; never the tokens."""
    from service.domain import auth

    if not ledger:
        tokens.list_own(ctx, all_)
        return

    table = Table("id", "user", "admin", "unix user", "code", "starts with", "created", "revoked")
    with _ledger() as session:
        for row in auth.list_tokens(session, include_revoked=all_):
            revoked = row.revoked_at.isoformat(timespec="seconds") if row.revoked_at else ""
            created = row.created_at.isoformat(timespec="seconds")
            admin = "yes" if row.admin else ""
            code = "yes" if row.allow_code else ""
            table.add_row(
                str(row.id), row.username, admin, row.unix_user or "", code, row.prefix, created, revoked
            )
    Console(highlight=False, width=160).print(table)


@token_app.command("revoke")
def token_revoke(
    ctx: typer.Context,
    token_id: Annotated[int, typer.Argument(metavar="ID", help="From `token list`.")],
    ledger: Annotated[bool, typer.Option("--ledger", help=LEDGER_HELP)] = False,
) -> None:
    """Revoke one of your tokens (an admin: anyone's; idempotent). Replicas stop accepting it within
    TORCHYARD_TOKEN_CACHE_S."""
    from service.domain import auth

    if not ledger:
        tokens.revoke_own(ctx, token_id)
        return

    with _ledger() as session:
        row = auth.revoke_token(session, token_id, actor="cli")
        user = row.username
    typer.echo(f"token {token_id} of {user} revoked")


@quota_app.command("set")
def quota_set(
    user: Annotated[str, typer.Option(help="Whose limits.")],
    max_active_jobs: Annotated[int | None, typer.Option(min=0, help="Unfinished jobs at once.")] = None,
    max_submissions_per_minute: Annotated[int | None, typer.Option(min=0)] = None,
    max_nodes: Annotated[int | None, typer.Option(min=0, help="Nodes per job.")] = None,
    max_tasks: Annotated[int | None, typer.Option(min=0, help="Tasks (ranks) per job.")] = None,
    max_gpus: Annotated[int | None, typer.Option(min=0, help="GPUs per job.")] = None,
    keep_finished_days: Annotated[
        float | None, typer.Option(min=0, help="Days their finished jobs' folders stay (0: for ever).")
    ] = None,
    allow_code: Annotated[
        Switch | None,
        typer.Option(help="May upload and run their own code, whatever their tokens say."),
    ] = None,
    reset: Annotated[bool, typer.Option("--reset", help="Back to the service's defaults.")] = False,
) -> None:
    """Set some of a user's limits; the ones not given keep their value."""
    from service.domain import audit, auth
    from service.ledger.models.access import UserQuota

    given: dict[str, float | bool | None] = {
        "max_active_jobs": max_active_jobs,
        "max_submissions_per_minute": max_submissions_per_minute,
        "max_nodes": max_nodes,
        "max_tasks": max_tasks,
        "max_gpus": max_gpus,
        "keep_finished_days": keep_finished_days,
        "allow_code": None if allow_code is None else allow_code is Switch.true,
    }
    with _ledger() as session:
        auth.check_user_name(user)
        row = UserQuota(username=user) if reset else session.get(UserQuota, user) or UserQuota(username=user)
        for name, value in given.items():
            if value is not None:
                setattr(row, name, value)
        session.merge(row)
        detail = ", ".join(f"{k}={v}" for k, v in given.items() if v is not None) or "reset"
        audit.record(session, "cli", "quota.set", f"user {user}", detail)
    typer.echo(f"limits for {user}: {detail} (replicas apply them within seconds)")


@quota_app.command("show")
def quota_show(user: Annotated[str, typer.Option(help="Whose limits.")]) -> None:
    """A user's limits in force: their own where set, else the service's defaults."""
    from service.config import Settings
    from service.domain.quotas import count_unfinished_of, limits_for

    with _ledger() as session:
        limits = limits_for(session, user, Settings())
        active = count_unfinished_of(session, [user])[user]
    for name, value in vars(limits).items():
        typer.echo(f"{name}: {value}")
    typer.echo(f"unfinished jobs now: {active}")


def gc(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only show what would go; change nothing.")
    ] = False,
) -> None:
    """Remove finished jobs' folders by the retention rules now (the service does it every
    TORCHYARD_GC_INTERVAL_S): what goes, and how many bytes."""
    from service.domain import retention

    with _service() as (settings, engine):
        report = retention.run_pass(engine, settings, dry_run=dry_run)
    table = Table("job", "owner", "ended", "removes", "bytes")
    for removal in report.removals:
        what = "the whole folder" if removal.removing == "folder" else "all but the logs"
        ended = removal.finished_at.isoformat(timespec="seconds")
        table.add_row(str(removal.job_id), removal.owner, ended, what, f"{removal.bytes:,}")
    Console(highlight=False, width=160).print(table)
    total = sum(removal.bytes for removal in report.removals)
    verb = "would free" if dry_run else "freed"
    freed = total if dry_run else report.freed
    typer.echo(f"{len(report.removals)} job folder(s); {verb} {freed:,} bytes")


def folders(
    limit: Annotated[int, typer.Option(min=1, max=1000, help="How many folders.")] = 20,
) -> None:
    """The largest job folders on disk, as last measured (/metrics shows only their total): whose
    jobs fill the data directory. GET /api/v1/folders answers the same to an admin token."""
    from service.domain import retention

    table = Table("job", "owner", "name", "state", "bytes", "measured")
    with _ledger() as session:
        totals = retention.folder_totals(session)
        for job in retention.largest_folders(session, limit):
            measured = job.folder_measured_at.isoformat(timespec="seconds") if job.folder_measured_at else ""
            table.add_row(str(job.id), job.owner, job.name, job.state, f"{job.folder_bytes or 0:,}", measured)
    Console(highlight=False, width=160).print(table)
    typer.echo(f"{totals.count} measured job folder(s) on disk, {totals.bytes:,} bytes in all")


code_app = typer.Typer(help="Uploaded code snapshots (on the service host).", no_args_is_help=True)


@code_app.command("gc")
def code_gc() -> None:
    """Remove the code snapshots no unfinished job uses, older than TORCHYARD_CODE_KEEP_H hours."""
    from service.config import Settings
    from service.domain import code_store

    settings = Settings()
    with _ledger() as session:
        removed = code_store.collect(session, settings)
    code_store.remove_files(settings, removed)  # after the commit: a failed one leaves rows with files
    typer.echo(f"removed {len(removed)} code snapshot(s)")
