"""free_port: the ports tests hand to processes they start, which bind them
later. A port the kernel picks with bind(0) is in its ephemeral range, where
any process's outgoing connection may take it before that bind (an engine's
publisher then fails with "Address already in use")."""

import socket

from ringside.sidecar_process import free_port


def ephemeral() -> tuple[int, int]:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        lo, hi = (int(x) for x in f.read().split())
    return lo, hi


def test_free_ports_are_outside_the_ephemeral_range_distinct_and_bindable():
    lo, hi = ephemeral()
    ports = [free_port() for _ in range(64)]
    assert len(set(ports)) == len(ports), ports
    for p in ports:
        assert not lo <= p <= hi, (p, lo, hi)
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_bound_port_is_not_given():
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        taken = held.getsockname()[1]
        assert all(free_port() != taken for _ in range(256))
