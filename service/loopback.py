"""Is an address this machine? Dev mode (no tokens) binds to and answers only such addresses."""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = frozenset({"localhost", "testclient"})  # Starlette's TestClient calls itself "testclient"


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
