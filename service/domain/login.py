"""Logging in with the cluster's identity: a MUNGE credential in, a token that expires out.

`torchyard login` makes a credential whose payload is `{"service": <this service's id>, "nonce": <a
fresh random string>}`; munged vouches for the uid that made it (service.domain.munge). The service
then checks, in this order:
- the payload names this service (a credential made for another torchyard cannot log in here) and
  carries a nonce, which the ledger remembers until the credential expires (UsedCredential): a
  credential logs in once, whichever replica sees it, even after munged (which remembers too) restarts;
- the uid is a person's: not root, not below TORCHYARD_MIN_LOGIN_UID, an account on this host.
The torchyard user is the account's name; its first login makes it (a token is all a user is:
service.domain.auth), not an admin unless the account is in one of TORCHYARD_ADMIN_GROUPS, with the
default quotas. Its jobs run as that account.

Refusals cost the caller: failed logins are counted per source address and per uid, in memory, at
most TRACKED keys each; past TORCHYARD_MAX_FAILED_LOGINS in WINDOW_S the source (or user) gets 429
before anything is decoded. Decodes under way at once are bounded too (each is a process).
Logins and refusals go to the audit log.

`check_account`, `issue`, the guard and `audit_refusal` are every login door's: the dashboard's LDAP
sign-in (service.domain.ldap_login) takes them too, so both doors make the same user and token.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

from cachetools import TTLCache
from sqlalchemy import delete
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from service.accounts import Account, shares_service_account, unfit_for_jobs
from service.config import Settings
from service.domain import audit, auth, munge
from service.domain.quotas import RetryLater
from service.errors import Forbidden, ServiceError, Unauthenticated
from service.ledger.db import session_scope
from service.ledger.models.access import ApiToken, UsedCredential
from service.ledger.models.columns import utcnow

NONCE = re.compile(r"[A-Za-z0-9_-]{16,64}")
WINDOW_S = 300.0
TRACKED = 10_000  # sources, and users, whose failures are remembered (the least recent let go first)
MAX_DECODES = 4  # unmunge processes at once; more logins at that moment get 429
VIA = "munge"
PROXY_VIA = "proxy"
T = TypeVar("T")


@dataclass(frozen=True)
class LoginAnswer:
    token: str
    user: str
    unix_user: str
    expires_at: datetime


class LoginGuard:
    """Failed logins per source and per uid in the last WINDOW_S, and the decodes under way."""

    def __init__(self, max_failures: int) -> None:
        self._max = max_failures
        self._failures: dict[str, TTLCache[str, deque[float]]] = {
            "source": TTLCache(TRACKED, WINDOW_S),
            "user": TTLCache(TRACKED, WINDOW_S),
        }
        self._lock = threading.Lock()
        self._decodes = threading.BoundedSemaphore(MAX_DECODES)

    def check(self, kind: str, key: str) -> None:
        """RetryLater when `key` (a source address, a uid) failed too often of late."""
        now = time.monotonic()
        with self._lock:
            times = self._failures[kind].get(key)
            while times and times[0] <= now - WINDOW_S:
                times.popleft()
            if times is not None and len(times) >= self._max:
                wait = times[0] + WINDOW_S - now
                raise RetryLater(f"too many failed logins from this {kind}; try again in {wait:.0f} s", wait)

    def failed(self, kind: str, key: str) -> None:
        with self._lock:
            cache = self._failures[kind]
            times = cache.get(key) or deque(maxlen=self._max)
            times.append(time.monotonic())
            cache[key] = times  # set again: a failure renews the key's time in the cache

    def decode(self, credential: str) -> munge.Decoded:
        return self.bounded(munge.decode, credential)

    def bounded(self, check: Callable[..., T], *args: Any) -> T:
        """`check(*args)` (an unmunge process, an LDAP bind) while fewer than MAX_DECODES run."""
        if not self._decodes.acquire(blocking=False):
            raise RetryLater("too many logins under way; try again in a moment", 1.0)
        try:
            return check(*args)
        finally:
            self._decodes.release()


def munge_login(
    engine: Engine, settings: Settings, guard: LoginGuard, credential: str, source: str
) -> LoginAnswer:
    """Log in with a MUNGE credential from `source` (the client's address): a new token, or the
    refusal (Unauthenticated, Forbidden, RetryLater), audited. No lock is held while unmunge runs."""
    guard.check("source", source)
    uid: int | None = None
    try:
        decoded = guard.decode(credential)
        uid = decoded.uid
        guard.check("user", str(uid))
        nonce = _check_payload(decoded.payload, settings)
        account = check_account(decoded.uid, settings)
        with session_scope(engine) as session:
            _remember(session, nonce, decoded)
            return issue(session, account, settings, source, VIA)
    except (Unauthenticated, Forbidden) as refusal:
        guard.failed("source", source)
        if uid is not None:
            guard.failed("user", str(uid))
        audit_refusal(engine, VIA, f"uid {uid}" if uid is not None else None, source, refusal)
        raise


def _check_payload(payload: bytes, settings: Settings) -> str:
    """The nonce of a payload made for this service."""
    try:
        fields = json.loads(payload)
    except ValueError:
        fields = None
    if not isinstance(fields, dict) or not isinstance(fields.get("nonce"), str):
        raise Unauthenticated(
            "the MUNGE credential's payload is not a torchyard login (use `torchyard login`)",
            field="credential",
        )
    if fields.get("service") != settings.login_service_id():
        raise Unauthenticated(
            "the MUNGE credential was made for another service, not this one "
            f"({settings.login_service_id()}): log in with `torchyard login --url` of this service",
            field="credential",
        )
    if not NONCE.fullmatch(fields["nonce"]):
        raise Unauthenticated("the MUNGE credential's nonce must be 16-64 random letters", field="credential")
    return str(fields["nonce"])


def check_account(uid: int, settings: Settings) -> Account:
    """The account of `uid` when a person may log in with it (Forbidden if not): every door's check."""
    if uid == 0:
        raise Forbidden("root may not log in: log in as your own account")
    if uid < settings.min_login_uid:
        raise Forbidden(
            f"uid {uid} is below TORCHYARD_MIN_LOGIN_UID ({settings.min_login_uid}): not a person's"
        )
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        raise Forbidden(f"uid {uid} has no account on the service's host") from None
    account = Account(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)
    if not (auth.USER_NAME.fullmatch(account.name) and auth.UNIX_NAME.fullmatch(account.name)):
        raise Forbidden(f"the account name {account.name!r} cannot be a torchyard user name")
    if not shares_service_account(settings) and (problem := unfit_for_jobs(account)) is not None:
        raise Forbidden(f"the account '{account.name}' {problem}: it may not log in")
    return account


def proxy_login(engine: Engine, settings: Settings, guard: LoginGuard, user: str, source: str) -> LoginAnswer:
    """A token for `user`, named by a trusted proxy's header (service.api.proxy_user) that signed
    the caller in (oauth2-proxy, mod_auth_openidc): the same user and token as the other doors."""
    guard.check("source", source)
    try:
        if not auth.UNIX_NAME.fullmatch(user):
            raise Forbidden(f"the proxy's user {user[:100]!r} is not a plain account name")
        return named_login(engine, settings, user, source, PROXY_VIA)
    except Forbidden as refusal:
        guard.failed("source", source)
        audit_refusal(engine, PROXY_VIA, user[:100], source, refusal)
        raise


def named_login(
    engine: Engine, settings: Settings, user: str, source: str, via: str, groups: frozenset[str] = frozenset()
) -> LoginAnswer:
    """A token for `user`, whom a door (LDAP, a trusted proxy) vouched for by name: the Unix account
    of that name, checked as a MUNGE login's uid is."""
    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        raise Forbidden(f"'{user}' has no account on the service's host") from None
    account = check_account(uid, settings)
    if account.name != user:
        raise Forbidden(f"uid {uid} is the account '{account.name}', not '{user}'")
    with session_scope(engine) as session:
        return issue(session, account, settings, source, via, groups)


def _remember(session: Session, nonce: str, decoded: munge.Decoded) -> None:
    """Keep the nonce until the credential expires (Unauthenticated when it was used before), and
    let go of those that have: the table holds only credentials still alive."""
    now = utcnow()
    session.execute(delete(UsedCredential).where(col(UsedCredential.expires_at) < now))
    expires = datetime.fromtimestamp(decoded.encode_time + decoded.ttl_s, timezone.utc)
    try:
        with session.begin_nested():
            session.add(UsedCredential(nonce=nonce, uid=decoded.uid, expires_at=max(expires, now)))
    except IntegrityError:
        raise Unauthenticated(
            "the MUNGE credential was used before (a replay): each login makes a new one", field="credential"
        ) from None


def issue(
    session: Session,
    account: Account,
    settings: Settings,
    source: str,
    via: str,
    groups: frozenset[str] = frozenset(),
) -> LoginAnswer:
    """A token for the account's user, made with its first login: the one path of every login door
    (`via`: munge, ldap). `groups`: those the door knows of besides the host's (LDAP's), for admins."""
    mapped = session.exec(
        select(ApiToken.unix_user).where(
            ApiToken.username == account.name, col(ApiToken.unix_user).is_not(None)
        )
    ).all()
    if any(other != account.name for other in mapped):
        raise Forbidden(
            f"the torchyard user '{account.name}' runs jobs as another account: ask the operator to rename it"
        )
    first = (
        session.exec(select(ApiToken.id).where(ApiToken.username == account.name).limit(1)).first() is None
    )
    admin = bool(set(settings.admin_groups) & (groups_of(account) | groups))
    expires = utcnow() + timedelta(hours=settings.login_token_hours)
    if first:
        audit.record(
            session, account.name, "user.create", f"user {account.name}", f"unix_user={account.name}"
        )
    raw = auth.create_token(
        session,
        account.name,
        admin=admin,
        unix_user=account.name,
        actor=account.name,
        expires_at=expires,
        via=via,
    )
    audit.record(session, account.name, "login", f"user {account.name}", f"via={via} source={source}")
    return LoginAnswer(raw, account.name, account.name, expires)


def groups_of(account: Account) -> set[str]:
    """The names of the account's groups on this host (its own and those that list it)."""
    names = set()
    for gid in os.getgrouplist(account.name, account.gid):
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue
    return names


def audit_refusal(
    engine: Engine, via: str, who: str | None, source: str, refusal: ServiceError
) -> None:
    """In a transaction of its own: the login's own (if any) was rolled back with the refusal."""
    with session_scope(engine) as session:
        audit.record(
            session, who or "anonymous", "login.refused", via, f"source={source}: {refusal.message}"[:1000]
        )
