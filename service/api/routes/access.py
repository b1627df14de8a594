"""/api/v1/whoami and /api/v1/audit: who the caller is, and (admins) who did what."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel

from service.api.deps import AdminUser, CurrentUser, SessionDep
from service.api.errors import error_responses
from service.domain import audit
from service.ledger.models.access import AuditEntryPublic

router = APIRouter(prefix="/api/v1", tags=["access"])


class WhoAmI(BaseModel):
    user: str
    admin: bool


@router.get(
    "/whoami",
    response_model=WhoAmI,
    summary="The caller, as the service knows them",
    responses=error_responses(422),
)
async def whoami(user: CurrentUser) -> WhoAmI:
    return WhoAmI(user=user.user, admin=user.admin)


@router.get(
    "/audit",
    response_model=list[AuditEntryPublic],
    summary="The audit log, newest first (admins)",
    responses=error_responses(422),
)
def audit_log(
    session: SessionDep,
    admin: AdminUser,
    actor: Annotated[str | None, Query(max_length=100, pattern=r"^[^\x00]*$")] = None,
    before_id: Annotated[int | None, Query(ge=1, le=2**63 - 1, description="Page back from this id.")] = None,
    limit: Annotated[int, Query(ge=1, le=audit.MAX_PAGE)] = 100,
) -> list[AuditEntryPublic]:
    rows = audit.list_entries(session, actor=actor, before_id=before_id, limit=limit)
    return [AuditEntryPublic.model_validate(row, from_attributes=True) for row in rows]
