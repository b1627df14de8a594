"""API tokens and who may see and touch which job.

A token is 32 random bytes shown once; the ledger keeps only its SHA-256. A slow password hash buys
nothing here: the secret is random, not a guessable word, and every request has to check one.
Users exist only as the names on their tokens. A job belongs to the user who submitted it; admins
see and touch every job.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from cachetools import TTLCache
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.domain import audit
from service.errors import InvalidRequest, NotFound, Unauthenticated
from service.ledger.models.access import ApiToken, UserQuota
from service.ledger.models.columns import utcnow

TOKEN_PREFIX = "ty_"
USER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,99}")
UNIX_NAME = re.compile(r"[a-z_][a-z0-9_.-]{0,31}\$?")  # what useradd accepts (NAME_REGEX)
DEV_USER = "dev"
TOKENS_KEPT = 10_000  # checked tokens remembered (TokenCheck)


@dataclass(frozen=True)
class Principal:
    """Who is asking."""

    user: str
    admin: bool = False
    unix_user: str | None = None  # the account the token maps its user to (service.accounts)
    allow_code: bool = False  # may run uploaded code (the quota row's word, else the token's)

    def may_see(self, owner: str) -> bool:
        return self.admin or owner == self.user

    def owner_filter(self) -> str | None:
        """The owner to restrict a listing to: None for an admin, who sees everyone's jobs."""
        return None if self.admin else self.user


DEV_PRINCIPAL = Principal(DEV_USER, admin=True)


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def check_user_name(user: str) -> str:
    if not USER_NAME.fullmatch(user):
        raise InvalidRequest(
            "must be 1-100 letters, digits or . _ @ - and start with a letter or digit", field="user"
        )
    return user


# ---------------------------------------------------------------- managing tokens


def create_token(
    session: Session,
    user: str,
    *,
    admin: bool = False,
    unix_user: str | None = None,
    allow_code: bool = False,
    actor: str = "operator",
    expires_at: datetime | None = None,
    via: str | None = None,
) -> str:
    """A new token for `user`, whose jobs run as `unix_user` when given (else the account of the user's
    own name, see service.accounts); the caller commits. The raw token is returned once, never stored."""
    if unix_user is not None and not UNIX_NAME.fullmatch(unix_user):
        raise InvalidRequest("is not a Unix account name", field="unix_user")
    raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = ApiToken(
        username=check_user_name(user),
        admin=admin,
        unix_user=unix_user,
        allow_code=allow_code,
        token_hash=hash_token(raw),
        prefix=raw[:10],
        expires_at=expires_at,
        via=via,
    )
    session.add(row)
    session.flush()
    detail = f"user={user} admin={admin}" + (f" unix_user={unix_user}" if unix_user else "")
    detail += " allow_code=True" if allow_code else ""
    detail += f" via={via} expires={expires_at.isoformat(timespec='seconds')}" if via and expires_at else ""
    audit.record(session, actor, "token.create", f"token {row.id}", detail)
    return raw


def list_tokens(
    session: Session, *, include_revoked: bool = False, user: str | None = None
) -> Sequence[ApiToken]:
    """Every token, or `user`'s own (a Principal's owner_filter: None for an admin)."""
    query = select(ApiToken)
    if user is not None:
        query = query.where(ApiToken.username == user)
    if not include_revoked:
        query = query.where(col(ApiToken.revoked_at).is_(None))
    return session.exec(query.order_by(col(ApiToken.id))).all()


def revoke_token(
    session: Session, token_id: int, *, actor: str = "operator", owner: str | None = None
) -> ApiToken:
    """Idempotent: revoking a revoked token changes nothing. With `owner`, only that user's own
    (another's is not found, as another's job is not). The caller commits."""
    row = session.get(ApiToken, token_id)
    if row is None or (owner is not None and row.username != owner):
        raise NotFound(f"token {token_id} not found", field="token_id")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.add(row)
        audit.record(session, actor, "token.revoke", f"token {token_id}", f"user={row.username}")
    return row


# ---------------------------------------------------------------- checking a request


def bearer_token(authorization: str | None) -> str:
    if not authorization:
        raise Unauthenticated("send an API token: 'Authorization: Bearer <token>'")
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise Unauthenticated("the Authorization header must be 'Bearer <token>'")
    return value.strip()


def may_run_code(session: Session, token: ApiToken) -> bool:
    """`torchyard quota set --allow-code` where the operator said so, else the token's --allow-code."""
    quota = session.get(UserQuota, token.username)
    if quota is not None and quota.allow_code is not None:
        return quota.allow_code
    return token.allow_code


class TokenCheck:
    """Token -> Principal, remembered for `ttl_s` seconds so a polling dashboard costs no query.

    A revoked token therefore keeps working on a replica for at most `ttl_s` seconds. An answer past
    half its life is `due`: the caller looks it up again while it still answers from this one, so
    a token in steady use is never waited on. At most TOKENS_KEPT answers are kept (a flood of
    made-up tokens must not grow memory), the least recently used let go first. The event loop
    reads the cache and lookup threads fill it: cachetools' caches are not thread-safe, hence the lock.
    """

    def __init__(self, engine: Engine, ttl_s: float) -> None:
        self._engine = engine
        self._ttl_s = ttl_s
        # digest -> (when it was looked up, its principal or None: not a valid token, when it expires)
        self._known: TTLCache[str, tuple[float, Principal | None, float | None]]
        self._known = TTLCache(TOKENS_KEPT, ttl_s)
        self._lock = threading.Lock()

    def _answer(self, raw: str) -> tuple[float, Principal | None, float | None] | None:
        with self._lock:
            return self._known.get(hash_token(raw))

    def cached(self, raw: str) -> Principal | None:
        """The cached answer for this token, or None when it must be looked up (`lookup`)."""
        answer = self._answer(raw)
        if answer is None:
            return None
        if answer[1] is None:
            raise Unauthenticated("this API token is not valid (unknown or revoked)")
        _check_expiry(answer[2])
        return answer[1]

    def due(self, raw: str) -> bool:
        """True when this token's cached answer is past half its life: time to look it up again."""
        answer = self._answer(raw)
        return answer is None or answer[0] + self._ttl_s / 2 < time.monotonic()

    def lookup(self, raw: str) -> Principal:
        digest = hash_token(raw)
        with Session(self._engine) as session:
            row = session.exec(select(ApiToken).where(ApiToken.token_hash == digest)).first()
            any_token = row is not None or session.exec(select(ApiToken.id).limit(1)).first() is not None
            principal = (
                Principal(row.username, row.admin, row.unix_user, may_run_code(session, row))
                if row is not None and row.revoked_at is None
                else None
            )
            expires = row.expires_at.timestamp() if row is not None and row.expires_at else None
        with self._lock:
            self._known[digest] = (time.monotonic(), principal, expires)
        if principal is None:
            if not any_token:
                raise Unauthenticated(
                    "this service has no API tokens yet: create one on the service host with "
                    "`torchyard token create --user NAME --admin`"
                )
            raise Unauthenticated("this API token is not valid (unknown or revoked)")
        _check_expiry(expires)
        return principal


def _check_expiry(expires: float | None) -> None:
    """Every token that has an expiry is refused from then on, the remembered ones too."""
    if expires is not None and time.time() >= expires:
        raise Unauthenticated("this API token has expired: log in again (`torchyard login`)")
