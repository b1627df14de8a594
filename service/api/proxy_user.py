"""The user a trusted reverse proxy names (TORCHYARD_PROXY_USER_HEADER, such as X-Forwarded-User):
believed only when the peer, the address that connected to the service, is in
TORCHYARD_TRUSTED_PROXIES; from anyone else the header is ignored, as if not sent.

The peer is kept in the scope by PeerMiddleware, outside uvicorn's ProxyHeadersMiddleware: that one
replaces the client with the address in X-Forwarded-For, which is not who connected.
"""

from __future__ import annotations

import ipaddress
from functools import cache

from starlette.types import ASGIApp, Receive, Scope, Send

from service.config import Settings

PEER = "torchyard.peer"  # the scope key: the address that connected, before any proxy header


class PeerMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("client"):
            scope[PEER] = scope["client"][0]
        await self._app(scope, receive, send)


@cache
def _networks(
    trusted: tuple[str, ...],
) -> tuple[bool, tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]]:
    """("*" in the list, the networks): entries that are neither (host names) trust nobody here."""
    networks = []
    for entry in trusted:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            continue
    return "*" in trusted, tuple(networks)


def is_trusted(peer: str, settings: Settings) -> bool:
    anyone, networks = _networks(tuple(settings.trusted_proxies))
    if anyone:
        return True
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:  # a Unix socket's peer, or none
        return False
    return any(address in network for network in networks)


def proxied_user(scope: Scope, settings: Settings) -> str | None:
    """The user the header names, when a trusted proxy sent it; else None (the header is ignored)."""
    if not settings.proxy_user_header:
        return None
    peer = scope.get(PEER) or (scope["client"][0] if scope.get("client") else "")
    if not is_trusted(peer, settings):
        return None
    wanted = settings.proxy_user_header.lower().encode("latin-1")
    for name, value in scope["headers"]:
        if name == wanted:
            return value.decode("latin-1").strip() or None
    return None
