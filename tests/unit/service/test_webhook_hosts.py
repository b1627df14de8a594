"""The webhook host lists (service.domain.webhook_hosts): listed hosts only, wildcards, no credentials,
listed ports only, no loopback, private, link-local or other non-public address unless the private
list names the host."""

from __future__ import annotations

import pytest

from service.domain.webhook_hosts import HostRules, Refused, Unresolved, address_problem, check_url

RULES = HostRules.of(
    ["hooks.example.org", "*.chat.example.org", "127.0.0.1", "::1", "internal.example.org", "10.1.2.3"],
    ["127.0.0.1", "internal.example.org"],
    ["80", "443", "8080-8081"],
)


def answering(*addresses: str) -> object:
    return lambda host, port: list(addresses)


def test_listed_public_hosts_pass() -> None:
    target = check_url("https://hooks.example.org/x?y=1", RULES, answering("93.184.216.34"))
    assert target.host == "hooks.example.org" and target.addresses == ("93.184.216.34",)
    assert (
        check_url("https://HOOKS.example.org./x", RULES, answering("93.184.216.34")).host
        == "hooks.example.org"
    )
    assert check_url("https://a.b.chat.example.org/x", RULES, answering("2606:4700::1")).host


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("https://evil.example.com/x", "not among the hosts"),
        ("https://chat.example.org/x", "not among the hosts"),  # *.chat.example.org: subdomains only
        ("https://hooks.example.org.evil.com/x", "not among the hosts"),
        ("https://xchat.example.org/x", "not among the hosts"),
        ("file:///etc/passwd", "http:// or https://"),
        ("gopher://hooks.example.org/x", "http:// or https://"),
        ("https://me:pw@hooks.example.org/x", "user name or password"),
        ("https://hooks.example.org:99999/x", "not a valid URL"),
        ("https:///x", "names no host"),
    ],
)
def test_refused_shapes_and_hosts(url: str, words: str) -> None:
    with pytest.raises(Refused, match=words):
        check_url(url, RULES, answering("93.184.216.34"))


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("10.0.0.7", "private"),
        ("192.168.1.1", "private"),
        ("172.16.0.1", "private"),
        ("169.254.169.254", "link-local"),  # cloud metadata
        ("fe80::1", "link-local"),
        ("fc00::1", "private"),
        ("224.0.0.1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped
        ("100.64.0.1", "not public"),  # carrier-grade NAT
    ],
)
def test_non_public_addresses_are_refused_unless_the_host_is_private_listed(address: str, kind: str) -> None:
    assert address_problem(address) == f"a {kind} address"
    with pytest.raises(Refused, match=rf"{kind} address.*TORCHYARD_WEBHOOK_PRIVATE_HOSTS"):
        check_url("https://hooks.example.org/x", RULES, answering("93.184.216.34", address))
    assert check_url("http://internal.example.org/x", RULES, answering(address)).addresses == (address,)


def test_ip_literals() -> None:
    assert check_url("http://127.0.0.1:8080/x", RULES, answering("127.0.0.1"))
    with pytest.raises(Refused, match="loopback"):
        check_url("http://[::1]:8080/x", RULES, answering("::1"))  # listed, not as private
    with pytest.raises(Refused, match="private"):
        check_url("http://10.1.2.3/x", RULES, answering("10.1.2.3"))
    with pytest.raises(Refused, match="not among"):
        check_url("http://127.0.0.2/x", RULES, answering("127.0.0.2"))


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("http://hooks.example.org/x", True),  # 80
        ("https://hooks.example.org/x", True),  # 443
        ("https://hooks.example.org:8081/x", True),  # in the listed range
        ("http://hooks.example.org:22/x", False),
        ("https://hooks.example.org:6379/x", False),
        ("http://hooks.example.org:8082/x", False),
        ("http://127.0.0.1:5432/x", False),  # a private-listed host too
    ],
)
def test_only_listed_ports(url: str, allowed: bool) -> None:
    """A user may not reach, nor probe, whatever else listens on an allowed host (finding 5)."""
    if allowed:
        assert check_url(url, RULES, answering("93.184.216.34"))
        return
    with pytest.raises(
        Refused, match=r"port \d+ is not among the ports webhooks may reach.*TORCHYARD_WEBHOOK_PORTS"
    ):
        check_url(url, RULES, answering("93.184.216.34"))


def test_by_default_only_80_and_443() -> None:
    rules = HostRules.of(["hooks.example.org"], [])
    assert rules.port_allowed(80) and rules.port_allowed(443) and not rules.port_allowed(8080)


def test_a_dns_change_is_seen_at_the_next_check() -> None:
    """Allowed when it resolved to a public address; refused once the name points at loopback."""
    answers = ["93.184.216.34"]
    resolver = lambda host, port: list(answers)  # noqa: E731
    check_url("https://hooks.example.org/x", RULES, resolver)
    answers[:] = ["127.0.0.1"]
    with pytest.raises(Refused, match=r"resolves to 127\.0\.0\.1, a loopback address"):
        check_url("https://hooks.example.org/x", RULES, resolver)


def test_no_hosts_turns_webhooks_off_and_no_address_is_unresolved() -> None:
    with pytest.raises(Refused, match=r"webhooks are off.*TORCHYARD_WEBHOOK_HOSTS"):
        check_url("https://hooks.example.org/x", HostRules.of([], []), answering("93.184.216.34"))
    with pytest.raises(Unresolved):
        check_url("https://hooks.example.org/x", RULES, answering())
    with pytest.raises(Unresolved):
        check_url("https://no-such-host.invalid/x", HostRules.of(["no-such-host.invalid"], []))
