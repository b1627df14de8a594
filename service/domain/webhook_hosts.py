"""Which URLs a webhook may reach: the operator's two host lists, checked when a subscription is made
and again before every delivery (a name's addresses can change after it was allowed).

A webhook is a request the service makes from inside the cluster, to a URL a user chose: without
these rules any user could make the service call its own database, a node's metadata service or an
internal admin page. So:
- only http and https, no user:password in the URL;
- the host must be named in TORCHYARD_WEBHOOK_HOSTS (`*.example.org` names every subdomain, not
  example.org itself); an empty list turns webhooks off;
- the port must be among TORCHYARD_WEBHOOK_PORTS (80 and 443 unless the operator lists more): a
  user must not probe, or talk to, whatever else listens on an allowed host;
- every address the host resolves to must be public (not loopback, private, link-local, multicast,
  reserved or unspecified), unless TORCHYARD_WEBHOOK_PRIVATE_HOSTS names the host too (an IP literal
  such as 127.0.0.1 may be named there).
Redirects are never followed (service.loops.notify); they would lead past these rules. A delivery
connects to an address checked here (service.loops.webhook_send), never to a second lookup's answer.

Pure but for `resolve`, the one function that asks DNS; tests replace it.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
SETTING = "TORCHYARD_WEBHOOK_HOSTS"
PRIVATE_SETTING = "TORCHYARD_WEBHOOK_PRIVATE_HOSTS"
PORTS_SETTING = "TORCHYARD_WEBHOOK_PORTS"


class Refused(ValueError):
    """The URL may not be called; the text says why (for a 422, or a delivery's last error)."""


class Unresolved(Refused):
    """The host has no address now: maybe for good (a typo), maybe not (DNS down)."""


@dataclass(frozen=True)
class HostRules:
    hosts: tuple[str, ...]  # lower case, no trailing dot
    private_hosts: tuple[str, ...]
    ports: tuple[tuple[int, int], ...] = ((80, 80), (443, 443))  # ranges, both ends allowed

    @classmethod
    def of(
        cls, hosts: Sequence[str], private_hosts: Sequence[str], ports: Sequence[str] = ("80", "443")
    ) -> HostRules:
        return cls(
            tuple(_normal(h) for h in hosts if h.strip()),
            tuple(_normal(h) for h in private_hosts),
            tuple(_port_range(text) for text in ports),
        )

    def port_allowed(self, port: int) -> bool:
        return any(low <= port <= high for low, high in self.ports)


def resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to now (the one DNS lookup of webhooks)."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        raise Unresolved(f"{host} does not resolve: {error}") from None
    return sorted({str(info[4][0]) for info in found})


@dataclass(frozen=True)
class Target:
    """A URL the rules allow, and the addresses its host had when checked."""

    url: str
    host: str
    port: int
    addresses: tuple[str, ...]


def check_url(url: str, rules: HostRules, resolver: Callable[[str, int], list[str]] | None = None) -> Target:
    """The URL's target when the rules allow it (resolving its host); raises Refused saying why."""
    host, port = check_shape(url, rules)
    addresses = (resolver or resolve)(host, port)
    if not addresses:
        raise Unresolved(f"{host} does not resolve")
    if not _listed(host, rules.private_hosts):
        for text in addresses:
            problem = address_problem(text)
            if problem is not None:
                raise Refused(
                    f"{host} resolves to {text}, {problem}: refused unless the operator names "
                    f"{host} in {PRIVATE_SETTING}"
                )
    return Target(url, host, port, tuple(addresses))


def check_shape(url: str, rules: HostRules) -> tuple[str, int]:
    """What needs no DNS: scheme, no credentials, a listed host. Returns (host, port)."""
    if not rules.hosts:
        raise Refused(
            f"webhooks are off on this service: the operator must name the hosts they may reach in {SETTING}"
        )
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise Refused(f"not a valid URL: {error}") from None
    if parts.scheme not in ("http", "https"):
        raise Refused("must be an http:// or https:// URL")
    if parts.username is not None or parts.password is not None:
        raise Refused("must not carry a user name or password")
    if not parts.hostname:
        raise Refused("names no host")
    host = _normal(parts.hostname)
    if not _listed(host, rules.hosts):
        raise Refused(f"host {host} is not among the hosts webhooks may reach ({SETTING})")
    port = port or (443 if parts.scheme == "https" else 80)
    if not rules.port_allowed(port):
        raise Refused(f"port {port} is not among the ports webhooks may reach ({PORTS_SETTING})")
    return host, port


def address_problem(text: str) -> str | None:
    """Why a webhook may not reach this address without the operator's word, or None."""
    address: Address = ipaddress.ip_address(text.split("%", 1)[0])  # no IPv6 zone
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    kinds = [
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("unspecified", address.is_unspecified),
        ("private", address.is_private),
        ("reserved", address.is_reserved),
        ("not public", not address.is_global),
    ]
    for kind, found in kinds:
        if found:
            return f"a {kind} address"
    return None


def _listed(host: str, names: Sequence[str]) -> bool:
    literal = _ip_literal(host)
    for name in names:
        if name.startswith("*."):
            if literal is None and host.endswith(name[1:]):
                return True
        elif name == host or (literal is not None and literal == _ip_literal(name)):
            return True
    return False


def _ip_literal(text: str) -> Address | None:
    try:
        return ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None


def _port_range(text: str) -> tuple[int, int]:
    low, _, high = text.strip().partition("-")
    return int(low), int(high or low)


def _normal(host: str) -> str:
    return host.strip().strip("[]").lower().rstrip(".")
