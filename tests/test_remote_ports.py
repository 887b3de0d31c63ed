"""Loopback test servers never lose their ports to the machine's outgoing connections (issue 23).

A port checked free and bound later must lie outside the kernel's ephemeral range, where any
outgoing connection (a pip download, another test's client) can take it in between; a first start
that still loses its port moves to new ports, a bounded number of times.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvtier.testing.redis import LocalCluster, LocalRedis, free_port


def ephemeral_range() -> tuple[int, int]:
    # Read here, not from the harness: the test checks the harness against the kernel.
    lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(lo), int(hi)


@contextmanager
def held(port: int) -> Iterator[socket.socket]:
    """Binds and listens on 127.0.0.1:port, as another process's server would."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", port))
        s.listen(1)
        yield s
    finally:
        s.close()


def test_ports_lie_outside_the_ephemeral_range() -> None:
    lo, hi = ephemeral_range()
    assert 1024 <= lo <= hi <= 65535
    for _ in range(200):
        p = free_port()
        assert not lo <= p <= hi, f"port {p} is inside the ephemeral range {lo}-{hi}"
        c = free_port(cluster=True)
        for q in (c, c + 10000):
            assert q <= 65535
            assert not lo <= q <= hi, f"cluster port {q} (node {c}) is inside the ephemeral range {lo}-{hi}"


def test_a_cluster_node_whose_bus_port_is_taken_moves_to_new_ports(tmp_path: Path) -> None:
    node = LocalRedis(tmp_path, cluster=True)
    first = node.port
    with held(first + 10000):  # taken between the pick and the start
        try:
            node.start()
            assert node.port != first
            assert node.port_retries == 1
            assert node.command("PING") == "PONG"
        finally:
            node.stop()


def test_a_server_whose_port_is_taken_moves_to_a_new_port(tmp_path: Path) -> None:
    server = LocalRedis(tmp_path)
    first = server.port
    with held(first), server:
        assert server.port != first
        assert server.command("PING") == "PONG"


def test_a_restart_keeps_its_port_and_says_when_it_is_taken(tmp_path: Path) -> None:
    server = LocalRedis(tmp_path)
    with server:
        port = server.port
    with held(port), pytest.raises(RuntimeError, match="Address already in use"):
        server.start()  # clients hold this URL: moving would be wrong
    server.start()
    try:
        assert server.port == port and server.command("PING") == "PONG"
    finally:
        server.stop()


def test_a_cluster_forms_while_one_bus_port_is_taken(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path, masters=3)
    taken = cluster.nodes[1].port + 10000
    with held(taken), cluster:
        assert cluster.nodes[1].port_retries == 1
        info = cluster.nodes[0].command("CLUSTER", "INFO")
        assert b"cluster_state:ok" in info
