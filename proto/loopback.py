"""Whether a ZeroMQ address stays on this machine: what --insecure allows.

The address is parsed, not prefix-matched: `tcp://127.evil.example:5555` starts like loopback
and resolves anywhere. Accepted: ipc:// and inproc:// (never leave the host), and tcp:// whose
host is a literal IPv4 address in 127.0.0.0/8, `[::1]`, or `localhost`, with a port (or `*`).
Anything else is refused, including what ZeroMQ would accept but this check cannot vouch for:
interface names (`tcp://lo:5555`), source;destination pairs, other transports.
"""
from __future__ import annotations

import ipaddress

_V4_LOOPBACK = ipaddress.IPv4Network("127.0.0.0/8")
_V6_LOOPBACK = ipaddress.IPv6Address("::1")
LOOPBACK_FORMS = "tcp:// to 127.0.0.0/8, [::1] or localhost with a port; ipc://; inproc://"


def is_loopback(address: str) -> bool:
    scheme, sep, rest = address.partition("://")
    if not sep or not rest:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host, colon, port = rest.rpartition(":")
    if not colon or not _is_port(port):
        return False
    if host == "localhost":
        return True
    if host.startswith("[") and host.endswith("]"):
        return _literal(host[1:-1]) == _V6_LOOPBACK
    ip = _literal(host)
    return isinstance(ip, ipaddress.IPv4Address) and ip in _V4_LOOPBACK


def _is_port(text: str) -> bool:
    # isdigit alone accepts '²' and other non-ASCII digits
    return text == "*" or (text.isascii() and text.isdigit() and int(text) <= 65535)


def _literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    # A scope id (`::1%eth0`) names an interface: not a literal we can vouch for.
    if "%" in host:
        return None
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None
