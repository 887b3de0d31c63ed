"""How much of a 4 MiB remote GET/SET is the Redis server's (docs/benchmarks.md, issue 19).

Usage: python scripts/remote_server_ab.py [ROUNDS]  (default 7; prints one line per figure)

Starts, on loopback: a minimal in-memory server (a process answering ``<i>\\n`` with ``$len``
and object i from a numpy array via ``sendall``: the machine's TCP ceiling for one connection),
a default ``redis-server`` and one with ``MALLOC_CONF=LARGE_VALUE_MALLOC_CONF``. Each round, in a
rotating order, times 32 x 4 MiB objects in batches of 16: a plain ``recv_into`` client's GETs
from each of the three, and kvtier's ``RemotePool.put`` + verified ``get`` on each Redis. Every
read is compared with what was written. Prints medians and per-round ratios (with the load
average), never a pass/fail: this is a measurement, not a test.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtier.bench.remote import _Round
from kvtier.remote import RemotePool
from kvtier.testing.redis import LARGE_VALUE_MALLOC_CONF, LocalRedis

N, SIZE, BATCH = 32, 4 << 20, 16


def values() -> Any:
    return np.random.default_rng(1).integers(0, 256, (N, SIZE), dtype=np.uint8)


def minimal_server(port_q: Any) -> None:
    objs = values()
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen()
        port_q.put(ls.getsockname()[1])
        c, _ = ls.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        f = c.makefile("rb")
        while line := f.readline():
            c.sendall(b"$%d\r\n" % SIZE)
            c.sendall(memoryview(objs[int(line)]))
            c.sendall(b"\r\n")


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def line(s: socket.socket) -> bytes:
    out = b""
    while not out.endswith(b"\r\n"):
        out += s.recv(1)
    return out


def plain_get(s: socket.socket, requests: list[bytes], out: Any) -> None:
    """Pipelined requests, each reply's value read straight into ``out[i]`` with ``recv_into``."""
    for b in range(0, N, BATCH):
        s.sendall(b"".join(requests[b : b + BATCH]))
        for i in range(b, b + BATCH):
            head = line(s)
            if head != b"$%d\r\n" % SIZE:
                raise RuntimeError(f"unexpected reply {head!r}")
            view, got = memoryview(out[i]), 0
            while got < SIZE:
                got += s.recv_into(view[got:], SIZE - got)
            if s.recv(2, socket.MSG_WAITALL) != b"\r\n":
                raise RuntimeError("value not followed by CRLF")


def plain_set(s: socket.socket, names: list[bytes], objs: Any) -> None:
    for i, name in enumerate(names):
        s.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, SIZE))
        s.sendall(memoryview(objs[i]))
        s.sendall(b"\r\n")
        if line(s) != b"+OK\r\n":
            raise RuntimeError("SET failed")


def main(rounds: int) -> None:
    objs, out = values(), np.zeros((N, SIZE), np.uint8)
    port_q: Any = mp.Queue()
    proc = mp.Process(target=minimal_server, args=(port_q,), daemon=True)
    proc.start()
    minimal = connect(port_q.get())
    names = [b"plain:%d" % i for i in range(N)]
    minimal_requests = [b"%d\n" % i for i in range(N)]

    def timed_get(fn: Callable[[], None]) -> float:
        out.fill(0)
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
        if not np.array_equal(out, objs):
            raise RuntimeError("a GET returned wrong bytes")
        return seconds

    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalRedis(tmp) as default,
        LocalRedis(tmp, malloc_conf=LARGE_VALUE_MALLOC_CONF) as tuned,
    ):
        cases: dict[str, Callable[[int], dict[str, float]]] = {}
        cases["minimal"] = lambda r: {
            "minimal get": timed_get(lambda: plain_get(minimal, minimal_requests, out))
        }
        for label, server in (("default", default), ("malloc_conf", tuned)):
            conn = connect(server.port)
            plain_set(conn, names, objs)
            requests = [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(n), n) for n in names]
            pool = RemotePool({"urls": [server.url], "cluster": False, "key_prefix": "ab:"}, bytes(16))

            def plain(
                r: int, conn: socket.socket = conn, req: list[bytes] = requests, lb: str = label
            ) -> dict[str, float]:
                return {f"redis {lb}: plain get": timed_get(lambda: plain_get(conn, req, out))}

            def kvtier(r: int, pool: RemotePool = pool, lb: str = label) -> dict[str, float]:
                rd = _Round(pool, objs, BATCH, 1 + r * N)
                t0 = time.perf_counter()
                rd.put()
                put_s = time.perf_counter() - t0
                get_s = timed_get(lambda: rd.get(out))
                rd.clean_kvtier()
                return {f"redis {lb}: kvtier put": put_s, f"redis {lb}: kvtier get": get_s}

            cases[f"{label} plain"] = plain
            cases[f"{label} kvtier"] = kvtier
        times: dict[str, list[float]] = {}
        loads = []
        order = list(cases)
        for r in range(rounds + 1):  # round 0 warms connections and server buffers, untimed
            k = r % len(order)
            for name in order[k:] + order[:k]:
                for label, seconds in cases[name](r).items():
                    if r:
                        times.setdefault(label, []).append(seconds)
            loads.append(os.getloadavg()[0])
    base = times["minimal get"]
    for name, t in times.items():
        ratio = [a / b for a, b in zip(t, base, strict=True)]
        print(
            f"{name:28s} median {statistics.median(t) * 1e3:7.1f} ms; time / minimal get: median "
            f"{statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f})"
        )
    for op in ("plain get", "kvtier put", "kvtier get"):
        d, m = times[f"redis default: {op}"], times[f"redis malloc_conf: {op}"]
        ratio = [a / b for a, b in zip(d, m, strict=True)]
        print(
            f"{op}: malloc_conf speed / default speed: median {statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f})"
        )
    print(f"rounds {rounds}; load average 1m {min(loads):.2f}-{max(loads):.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
