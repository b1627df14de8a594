"""/api/v1/auth/*: logging in with the cluster's identity (MUNGE) or the site's LDAP, without a token
(public paths)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from service.api.deps import RuntimeDep
from service.api.errors import error_responses
from service.api.proxy_user import proxied_user
from service.domain import auth, ldap_login, login
from service.domain.munge import MAX_CREDENTIAL_CHARS
from service.errors import Unauthenticated

router = APIRouter(prefix="/api/v1/auth", tags=["auth"])


class ServiceIdentity(BaseModel):
    service_id: str = Field(description="What a MUNGE login's payload must name (TORCHYARD_SERVICE_ID).")
    ldap: bool = Field(
        False, description="Whether POST /api/v1/auth/ldap signs in here (TORCHYARD_LDAP_URL is set)."
    )


class MungeLogin(BaseModel):
    credential: Annotated[
        str,
        Field(
            min_length=1,
            max_length=MAX_CREDENTIAL_CHARS,
            description='`munge -s \'{"service": ID, "nonce": N}\'` (see GET /api/v1/auth/service).',
        ),
    ]


class LdapLogin(BaseModel):
    # A plain account name only: it goes into a DN and a filter (escaped there too).
    user: Annotated[str, Field(min_length=1, max_length=32, pattern=auth.UNIX_NAME.pattern)]
    password: Annotated[str, Field(min_length=1, max_length=1000)]


class LoginToken(BaseModel):
    token: str = Field(description="Shown once; send it as 'Authorization: Bearer <token>'.")
    user: str
    unix_user: str = Field(description="The account the user's jobs run as.")
    expires_at: datetime


@router.get(
    "/service",
    response_model=ServiceIdentity,
    summary="Whom a MUNGE login is made for, and whether LDAP signs in here",
    responses=error_responses(422),
)
async def service_identity(runtime: RuntimeDep) -> ServiceIdentity:
    return ServiceIdentity(
        service_id=runtime.settings.login_service_id(), ldap=bool(runtime.settings.ldap_url)
    )


@router.post(
    "/munge",
    response_model=LoginToken,
    summary="Log in with a MUNGE credential: a token for its account, which expires",
    responses=error_responses(401, 403, 422, 429, 503),
)
def munge_login(body: MungeLogin, request: Request, runtime: RuntimeDep) -> LoginToken:
    source = request.client.host if request.client else "unknown"
    answer = login.munge_login(runtime.engine, runtime.settings, runtime.logins, body.credential, source)
    return LoginToken(
        token=answer.token, user=answer.user, unix_user=answer.unix_user, expires_at=answer.expires_at
    )


@router.post(
    "/ldap",
    response_model=LoginToken,
    summary="Sign in with the site's LDAP user name and password: the same token as a MUNGE login's",
    responses=error_responses(401, 403, 404, 422, 429, 503),
)
def ldap_sign_in(body: LdapLogin, request: Request, runtime: RuntimeDep) -> LoginToken:
    source = request.client.host if request.client else "unknown"
    answer = ldap_login.ldap_login(
        runtime.engine, runtime.settings, runtime.logins, body.user, body.password, source
    )
    return LoginToken(
        token=answer.token, user=answer.user, unix_user=answer.unix_user, expires_at=answer.expires_at
    )


@router.post(
    "/proxy",
    response_model=LoginToken,
    summary="Sign in as the user a trusted reverse proxy names: the same token as a MUNGE login's",
    responses=error_responses(401, 403, 422, 429),
)
def proxy_sign_in(request: Request, runtime: RuntimeDep) -> LoginToken:
    settings = runtime.settings
    user = proxied_user(request.scope, settings)
    if user is None:
        raise Unauthenticated(
            "no trusted proxy signed you in: the user header "
            f"({settings.proxy_user_header or 'TORCHYARD_PROXY_USER_HEADER is not set'}) counts only from "
            "TORCHYARD_TRUSTED_PROXIES"
        )
    source = request.client.host if request.client else "unknown"
    answer = login.proxy_login(runtime.engine, settings, runtime.logins, user, source)
    return LoginToken(
        token=answer.token, user=answer.user, unix_user=answer.unix_user, expires_at=answer.expires_at
    )
