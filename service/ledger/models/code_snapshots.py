"""Code snapshots: each user's claim on a stored snapshot, and the answers to an upload."""

from __future__ import annotations

from datetime import datetime

import pydantic
from pydantic import BaseModel
from sqlalchemy import BigInteger
from sqlmodel import Field, SQLModel

from service.ledger.models.columns import UTCDateTime, utcnow


class CodeSnapshot(SQLModel, table=True):
    """One user's claim on one stored snapshot: the files are stored once, by content, however many
    users upload them (service.domain.code_store)."""

    digest: str = Field(primary_key=True, max_length=64)  # SHA-256 of the archive, hex
    owner: str = Field(primary_key=True, max_length=100)
    bytes: int = Field(sa_type=BigInteger)
    # What its files take unpacked: the copy its jobs share costs this much disk, so it counts against
    # the owner's TORCHYARD_MAX_CODE_BYTES_PER_USER with the archive (service.domain.code_store).
    unpacked_bytes: int = Field(default=0, sa_type=BigInteger)
    files: int
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    # Its latest upload by this owner: collection keeps a snapshot TORCHYARD_CODE_KEEP_H after it.
    uploaded_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class CodeSnapshotPublic(BaseModel):
    """The answer to an upload."""

    id: str = pydantic.Field(description="`sha256:<hex>`: what a job's `code` names.")
    bytes: int = pydantic.Field(description="The archive's size.")
    unpacked_bytes: int = pydantic.Field(
        0, description="What its files take unpacked; counted with `bytes` against your limit."
    )
    files: int = pydantic.Field(description="Files in it (links included, folders not).")
    created_at: datetime = pydantic.Field(description="When you first uploaded it.")
    uploaded_at: datetime = pydantic.Field(
        description="When you last uploaded it: the service keeps it TORCHYARD_CODE_KEEP_H hours after the "
        "latest upload by anyone, and while an unfinished job uses it."
    )


class CodeSnapshotDetail(CodeSnapshotPublic):
    """One snapshot with its file list."""

    paths: list[str] = pydantic.Field(description="Its files, sorted (at most 10000 shown).")
