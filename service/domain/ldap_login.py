"""Signing in with the site's LDAP: a user name and password in, the same token `torchyard login` gets.

The password is checked by binding as the user to TORCHYARD_LDAP_URL: the DN is
TORCHYARD_LDAP_USER_DN with {user} filled in, or the one entry TORCHYARD_LDAP_SEARCH_FILTER finds
under TORCHYARD_LDAP_SEARCH_BASE, searched bound as the service (TORCHYARD_LDAP_BIND_DN). The LDAP
user is the Unix account of that name on this host, checked as a MUNGE login's is
(service.domain.login.check_account), and the token comes from the one path every login door takes
(service.domain.login.named_login, issue). Admins: members of TORCHYARD_ADMIN_GROUPS,
Unix groups or LDAP groups under TORCHYARD_LDAP_GROUP_BASE.

The user name is a plain account name (auth.UNIX_NAME) before it reaches a DN or a filter, and it is
escaped there all the same (LDAP injection). A wrong password and an unknown user get the same words;
an empty password is refused before LDAP sees it (an LDAP simple bind without one is anonymous and
succeeds). Failures count in the same limiter as MUNGE logins' (per source, per user), binds under way
at once are bounded with unmunge's, and logins and refusals go to the audit log.
"""

from __future__ import annotations

import pwd
import ssl
from typing import Any

from sqlalchemy.engine import Engine

from service.config import Settings
from service.domain import auth
from service.domain.login import LoginAnswer, LoginGuard, audit_refusal, named_login
from service.errors import Forbidden, InvalidRequest, NotFound, Unauthenticated, Unavailable

VIA = "ldap"
REFUSED = "wrong user name or password"
INVALID_CREDENTIALS = 49  # LDAP's resultCode for a wrong password and for a DN that does not exist
MAX_GROUPS = 1000  # of one user, read from LDAP


def ldap_login(
    engine: Engine, settings: Settings, guard: LoginGuard, user: str, password: str, source: str
) -> LoginAnswer:
    """Log in as `user` with `password`, from `source` (the client's address): a new token, or the
    refusal (Unauthenticated, Forbidden, RetryLater), audited."""
    if not settings.ldap_url:
        raise NotFound("this service signs in with no LDAP (TORCHYARD_LDAP_URL is not set)")
    if not auth.UNIX_NAME.fullmatch(user):
        raise InvalidRequest(
            "the user name must be a plain account name (letters, digits, _ . -)", field="user"
        )
    guard.check("source", source)
    key = _user_key(user)
    try:
        guard.check("user", key)
        if not password:
            raise Unauthenticated(REFUSED, field="password")
        groups = guard.bounded(_bind, settings, user, password)
        return named_login(engine, settings, user, source, VIA, groups)
    except (Unauthenticated, Forbidden) as refusal:
        guard.failed("source", source)
        guard.failed("user", key)
        audit_refusal(engine, VIA, user, source, refusal)
        raise


def _user_key(user: str) -> str:
    """The limiter's key for `user`: its uid (as a MUNGE login's) when the host knows the name, so
    failures through either door count together."""
    try:
        return str(pwd.getpwnam(user).pw_uid)
    except KeyError:
        return f"name {user}"


def _bind(settings: Settings, user: str, password: str) -> frozenset[str]:
    """Bind as the user (Unauthenticated when LDAP refuses), then the names of its LDAP groups."""
    import ldap3  # heavy, and only the dashboard's sign-in needs it
    from ldap3.core.exceptions import LDAPException
    from ldap3.utils.conv import escape_filter_chars

    timeout = settings.ldap_timeout_s
    try:
        # ldaps:// checked against the system's trusted CAs and the host's name: ldap3 checks neither
        # unless told, and the passwords go over this connection.
        tls = ldap3.Tls(validate=ssl.CERT_REQUIRED)
        server = ldap3.Server(settings.ldap_url, connect_timeout=timeout, get_info=ldap3.NONE, tls=tls)
        dn = _user_dn(server, settings, user)
        connection = _connection(server, dn, password, timeout)
        try:
            if not connection.bind():
                if connection.result.get("result") == INVALID_CREDENTIALS:
                    raise Unauthenticated(REFUSED, field="password")
                raise Unavailable(f"the site's LDAP refused the bind: {connection.result.get('description')}")
            if not settings.ldap_group_base:
                return frozenset()
            member = f"(|(memberUid={escape_filter_chars(user)})(member={escape_filter_chars(dn)}))"
            connection.search(
                settings.ldap_group_base, member, attributes=["cn"], size_limit=MAX_GROUPS, time_limit=timeout
            )
            return frozenset(str(name) for entry in connection.entries for name in entry.cn.values)
        finally:
            connection.unbind()
    except LDAPException as error:
        raise Unavailable(f"the site's LDAP ({settings.ldap_url}) did not answer: {error}") from None


def _connection(server: Any, dn: str | None, password: str | None, timeout: int) -> Any:
    import ldap3

    return ldap3.Connection(
        server, user=dn, password=password, receive_timeout=timeout, read_only=True, raise_exceptions=False
    )


def _user_dn(server: Any, settings: Settings, user: str) -> str:
    """The DN to bind as: the template's, or the one entry the search finds (bound as the service)."""
    from ldap3.utils.conv import escape_filter_chars
    from ldap3.utils.dn import escape_rdn

    if not settings.ldap_search_base:
        return settings.ldap_user_dn.replace("{user}", escape_rdn(user))
    password = settings.ldap_bind_password.get_secret_value()
    service = _connection(server, settings.ldap_bind_dn or None, password or None, settings.ldap_timeout_s)
    try:
        if not service.bind():
            raise Unavailable(
                f"the site's LDAP refused this service's bind (TORCHYARD_LDAP_BIND_DN): "
                f"{service.result.get('description')}"
            )
        wanted = settings.ldap_search_filter.replace("{user}", escape_filter_chars(user))
        # Two at most: one is the user, more is a filter that names no one for certain.
        service.search(settings.ldap_search_base, wanted, size_limit=2, time_limit=settings.ldap_timeout_s)
        if len(service.entries) != 1:
            raise Unauthenticated(REFUSED, field="password")  # the same words as a wrong password
        return str(service.entries[0].entry_dn)
    finally:
        service.unbind()
