"""The HTTP port's connection pools (gateway/bounds/http_pools.py): what a connection that has shown no
key may take, and what a keyed one may."""
from __future__ import annotations

import pytest

from gateway.bounds.http_pools import ConnectionPools, PoolLimits, cidr


class Conn:
    def __init__(self, idle: bool = True) -> None:
        self.idle, self.evicted = idle, False

    def evict(self) -> None:
        self.evicted = True


def test_a_full_waiting_pool_closes_its_oldest_idle_connection_for_a_new_one():
    pools = ConnectionPools(PoolLimits(max_unauthenticated=3))
    busy, old, young = Conn(idle=False), Conn(), Conn()
    for i, conn in enumerate((busy, old, young)):
        assert pools.opened(conn, f"10.0.0.{i}")
    new = Conn()
    assert pools.opened(new, "10.0.0.9")
    assert (busy.evicted, old.evicted, young.evicted) == (False, True, False)  # busy is skipped
    assert pools.counts() == {"waiting": 3, "admitted": 0, "peers": 3}
    pools.closed(old)  # its connection_lost, later: nothing left to uncount
    assert pools.counts()["waiting"] == 3


def test_a_waiting_pool_of_connections_being_answered_refuses_a_new_one():
    pools = ConnectionPools(PoolLimits(max_unauthenticated=2))
    held = [Conn(idle=False), Conn(idle=False)]
    for conn in held:
        assert pools.opened(conn, "10.0.0.1")
    assert not pools.opened(Conn(), "10.0.0.2")
    assert not any(c.evicted for c in held)


def test_an_admitted_connection_leaves_the_waiting_pool_and_is_never_evicted():
    pools = ConnectionPools(PoolLimits(max_unauthenticated=1))
    keyed = Conn()
    assert pools.opened(keyed, "10.0.0.1")
    assert pools.admit(keyed, "kA/", "10.0.0.1") is None
    for i in range(5):  # idle sockets come and go; the keyed connection stays
        assert pools.opened(Conn(), f"10.0.1.{i}")
    assert not keyed.evicted
    assert pools.counts() == {"waiting": 1, "admitted": 1, "peers": 2}  # the evicted uncounted


def test_a_request_without_a_valid_key_keeps_its_connection_waiting():
    pools = ConnectionPools()
    conn = Conn()
    pools.opened(conn, "10.0.0.1")
    assert pools.admit(conn, None, "10.0.0.1") is None
    assert pools.counts() == {"waiting": 1, "admitted": 0, "peers": 1}


def test_admitted_connections_are_bounded_per_key_and_in_total():
    pools = ConnectionPools(PoolLimits(max_admitted=3, max_per_key=2))
    conns = [Conn() for _ in range(5)]
    for conn in conns:
        pools.opened(conn, "10.0.0.1")
    assert pools.admit(conns[0], "kA/", "10.0.0.1") is None
    assert pools.admit(conns[1], "kA/", "10.0.0.1") is None
    refusal = pools.admit(conns[2], "kA/", "10.0.0.1")
    assert (refusal.status, refusal.type) == (429, "rate_limit_error")
    assert refusal.message == ("this API key has 2 HTTP connections open "
                               "(--max-http-connections-per-key)")
    assert pools.admit(conns[2], "kB/", "10.0.0.1") is None
    refusal = pools.admit(conns[3], "kB/", "10.0.0.1")
    assert refusal.status == 503 and "(--max-http-connections)" in refusal.message
    pools.closed(conns[0])
    assert pools.admit(conns[3], "kA/", "10.0.0.1") is None
    assert pools.admit(conns[3], "kA/", "10.0.0.1") is None  # its next request: already in


def test_without_keys_every_request_admits_and_no_per_key_bound_applies():
    pools = ConnectionPools(PoolLimits(max_per_key=1))
    conns = [Conn() for _ in range(3)]
    for conn in conns:
        pools.opened(conn, "10.0.0.1")
        assert pools.admit(conn, "", "10.0.0.1") is None
    assert pools.counts()["admitted"] == 3


def test_connections_are_bounded_per_peer():
    pools = ConnectionPools(PoolLimits(max_per_peer=2))
    first, second = Conn(), Conn()
    assert pools.opened(first, "10.0.0.1") and pools.opened(second, "10.0.0.1")
    assert not pools.opened(Conn(), "10.0.0.1")
    assert pools.opened(Conn(), "10.0.0.2")
    pools.closed(first)
    assert pools.opened(Conn(), "10.0.0.1")


def test_x_forwarded_for_is_read_only_from_a_trusted_proxy():
    pools = ConnectionPools(PoolLimits(max_per_peer=1, trusted_proxies=(cidr("10.1.0.0/16"),)))
    forged = [b"192.0.2.1, 198.51.100.7", b"10.1.2.3"]  # the client wrote the first one itself
    assert pools.client_of("10.1.0.5", forged) == "198.51.100.7"
    assert pools.client_of("203.0.113.9", forged) == "203.0.113.9"  # not a proxy: ignored
    assert pools.client_of("10.1.0.5", []) == "10.1.0.5"
    # A proxy's connections are not bounded by its own address, but by the clients it carries.
    via = [Conn() for _ in range(3)]
    for conn in via:
        assert pools.opened(conn, "10.1.0.5")
    assert pools.admit(via[0], "", "198.51.100.7") is None
    refusal = pools.admit(via[1], "", "198.51.100.7")
    assert refusal.status == 429 and "(--max-http-connections-per-peer)" in refusal.message
    assert pools.admit(via[2], "", "198.51.100.8") is None


@pytest.mark.parametrize("text", ["foo", "10.0.0.0/33", ""])
def test_a_bad_trusted_proxy_is_refused_naming_the_flag(text):
    with pytest.raises(ValueError, match="--trusted-proxies"):
        cidr(text)
