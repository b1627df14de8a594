"""/api/v1/whoami, /api/v1/tokens and /api/v1/audit: who the caller is, their tokens (an admin's:
everyone's), and (admins) who did what."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel

from service.api.deps import AdminUser, CurrentUser, SessionDep
from service.api.errors import error_responses
from service.domain import audit, auth
from service.ledger.models.access import ApiTokenPublic, AuditEntryPublic

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


@router.get(
    "/tokens",
    response_model=list[ApiTokenPublic],
    summary="Your tokens (an admin's: every user's), never the secrets",
    responses=error_responses(422),
)
def list_tokens(
    session: SessionDep,
    user: CurrentUser,
    all_: Annotated[bool, Query(alias="all", description="Include revoked tokens.")] = False,
) -> list[ApiTokenPublic]:
    rows = auth.list_tokens(session, include_revoked=all_, user=user.owner_filter())
    return [ApiTokenPublic.model_validate(row, from_attributes=True) for row in rows]


@router.post(
    "/tokens/{token_id}/revoke",
    response_model=ApiTokenPublic,
    summary="Revoke one of your tokens (an admin: anyone's); idempotent",
    responses=error_responses(404, 422),
)
def revoke_token(
    session: SessionDep, user: CurrentUser, token_id: Annotated[int, Path(ge=1, le=2**63 - 1)]
) -> ApiTokenPublic:
    row = auth.revoke_token(session, token_id, actor=user.user, owner=user.owner_filter())
    return ApiTokenPublic.model_validate(row, from_attributes=True)
