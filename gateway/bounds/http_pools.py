"""The HTTP port's connections in two pools, so that connections which have shown nothing cannot
take the room of clients that have a key.

A connection starts in the waiting pool (--max-http-unauthenticated-connections). It moves to
the admitted pool when a request on it presents a valid API key (without --api-key: when it
sends any request's headers); the admitted pool is bounded in total (--max-http-connections)
and per key (--max-http-connections-per-key), so one tenant cannot take every slot either.

When the waiting pool is full, a new connection closes the oldest idle waiting one rather than
being refused. Refusing the new one would hand the port to whoever fills the pool first: a
keyed client's fresh connection is a waiting one until its headers arrive, so an attacker
holding idle sockets would lock every keyed client out. Evicting the oldest, an attacker must
open connections faster than the pool turns over to starve anyone, while a keyed client needs
its connection to live only the milliseconds its headers take to arrive.

Every connection also counts against its peer (--max-http-connections-per-peer): the direct
peer's address, or, from a --trusted-proxies address, the client X-Forwarded-For names (the
last address in it that is not itself a trusted proxy), once a request's headers say so.
"""
from __future__ import annotations

import ipaddress
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Protocol

from uvicorn.middleware.proxy_headers import _TrustedHosts


class Connection(Protocol):
    @property
    def idle(self) -> bool:
        """No request is being served on it (it may be sending headers)."""

    def evict(self) -> None:
        """Closes it; the protocol reports closed() later."""


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str
    type: str


@dataclass(frozen=True)
class PoolLimits:
    max_unauthenticated: int = 256
    max_admitted: int = 1024
    max_per_key: int = 512
    max_per_peer: int = 256
    trusted_proxies: tuple[str, ...] = ()


def cidr(text: str) -> str:
    """A --trusted-proxies entry, an address or a network; ValueError names a bad one."""
    try:
        return str(ipaddress.ip_network(text.strip(), strict=False))
    except ValueError:
        raise ValueError(f"--trusted-proxies wants addresses or CIDR networks, got {text!r}") \
            from None


class ConnectionPools:
    def __init__(self, limits: PoolLimits = PoolLimits()) -> None:
        self.limits = limits
        proxies = list(limits.trusted_proxies)
        self._proxies = _TrustedHosts(proxies) if proxies else None
        self._waiting: OrderedDict[Connection, None] = OrderedDict()  # oldest first
        self._admitted: dict[Connection, str] = {}  # its tenant
        self._per_key: Counter[str] = Counter()
        self._peer: dict[Connection, str] = {}
        self._per_peer: Counter[str] = Counter()

    def trusted(self, address: str) -> bool:
        return self._proxies is not None and address in self._proxies

    def opened(self, conn: Connection, address: str) -> bool:
        """Counts a new connection from `address`; False: close it at once."""
        proxied = self.trusted(address)
        if not proxied and self._per_peer[address] >= self.limits.max_per_peer:
            return False
        if len(self._waiting) >= self.limits.max_unauthenticated:
            oldest = next((c for c in self._waiting if c.idle), None)
            if oldest is None:  # every waiting one is being answered (briefly: no key, no body)
                return False
            self.closed(oldest)
            oldest.evict()
        self._waiting[conn] = None
        if not proxied:  # a proxy's connections count against the clients they carry
            self._count_peer(conn, address)
        return True

    def client_of(self, address: str, forwarded_for: list[bytes]) -> str:
        """The peer a request counts against: behind a trusted proxy, the client it names."""
        if not forwarded_for or not self.trusted(address):
            return address
        hosts = b",".join(forwarded_for).decode("latin-1")
        return self._proxies.get_trusted_client_address(hosts)[0] or address

    def admit(self, conn: Connection, tenant: str | None, client: str) -> Refusal | None:
        """A request's headers. tenant: "" without keys, None without a valid key (the request
        is answered, 401 or an open route, but the connection keeps waiting). A refusal is
        answered with the connection closed."""
        if self._peer.get(conn) != client:
            if self._per_peer[client] >= self.limits.max_per_peer:
                return Refusal(429, f"this client has {self._per_peer[client]} HTTP connections "
                                    "open (--max-http-connections-per-peer)", "rate_limit_error")
            self._count_peer(conn, client)
        if tenant is None or conn in self._admitted:
            return None
        if tenant and self._per_key[tenant] >= self.limits.max_per_key:
            return Refusal(429, f"this API key has {self._per_key[tenant]} HTTP connections open "
                                "(--max-http-connections-per-key)", "rate_limit_error")
        if len(self._admitted) >= self.limits.max_admitted:
            return Refusal(503, f"the gateway has {len(self._admitted)} HTTP connections of "
                                "clients open (--max-http-connections)",
                           "service_unavailable_error")
        self._waiting.pop(conn, None)
        self._admitted[conn] = tenant
        self._per_key[tenant] += 1
        return None

    def closed(self, conn: Connection) -> None:
        self._waiting.pop(conn, None)
        tenant = self._admitted.pop(conn, None)
        if tenant is not None:
            self._uncount(self._per_key, tenant)
        peer = self._peer.pop(conn, None)
        if peer is not None:
            self._uncount(self._per_peer, peer)

    def _count_peer(self, conn: Connection, peer: str) -> None:
        old = self._peer.get(conn)
        if old is not None:
            self._uncount(self._per_peer, old)
        self._peer[conn] = peer
        self._per_peer[peer] += 1

    @staticmethod
    def _uncount(counter: Counter, key: str) -> None:
        counter[key] -= 1
        if counter[key] <= 0:
            del counter[key]

    def counts(self) -> dict[str, int]:
        return {"waiting": len(self._waiting), "admitted": len(self._admitted),
                "peers": len(self._per_peer)}
