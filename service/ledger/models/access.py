"""Access: API tokens, the audit log and per-user quotas."""

from __future__ import annotations

from datetime import datetime

from sqlmodel import Field, SQLModel

from service.ledger.models.columns import UTCDateTime, time_column, utcnow


class ApiToken(SQLModel, table=True):
    """One API token. Only its SHA-256 is stored: the ledger never holds a usable secret."""

    id: int | None = Field(default=None, primary_key=True)
    username: str = Field(max_length=100, index=True)
    admin: bool = False
    unix_user: str | None = Field(default=None, max_length=64, description="The account jobs run as.")
    allow_code: bool = Field(default=False, description="May run uploaded code (code snapshots).")
    token_hash: str = Field(max_length=64, unique=True)
    prefix: str = Field(max_length=16, description="The token's first characters, to tell tokens apart.")
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    revoked_at: datetime | None = time_column()
    expires_at: datetime | None = time_column()  # a login's token expires; a created one need not
    via: str | None = Field(default=None, max_length=16, description="'munge': made by a login.")


class ApiTokenPublic(SQLModel):
    """A token as its owner sees it: never the token itself, nor its hash."""

    id: int
    username: str
    admin: bool
    unix_user: str | None
    prefix: str
    via: str | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


class UsedCredential(SQLModel, table=True):
    """A MUNGE credential's nonce, kept until the credential expires so that it logs in only once,
    whichever replica decodes it and whether or not munged (which remembers too) restarted since."""

    nonce: str = Field(primary_key=True, max_length=64)
    uid: int
    expires_at: datetime = Field(sa_type=UTCDateTime, index=True)


class AuditEntry(SQLModel, table=True):
    """Who did what to which job or token, and when. Written in the same transaction as the act."""

    id: int | None = Field(default=None, primary_key=True)
    time: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime, index=True)
    actor: str = Field(max_length=100, index=True)
    action: str = Field(max_length=40)
    target: str = Field(max_length=100)
    detail: str | None = None


class AuditEntryPublic(SQLModel):
    id: int
    time: datetime
    actor: str
    action: str
    target: str
    detail: str | None


class UserQuota(SQLModel, table=True):
    """One user's limits where they differ from the service's defaults (a missing value: the default)."""

    username: str = Field(primary_key=True, max_length=100)
    max_active_jobs: int | None = None
    max_submissions_per_minute: int | None = None
    max_nodes: int | None = None
    max_tasks: int | None = None
    max_gpus: int | None = None
    keep_finished_days: float | None = None  # 0: for ever (TORCHYARD_KEEP_FINISHED_DAYS)
    allow_code: bool | None = None  # may run uploaded code; None: as the user's token says
