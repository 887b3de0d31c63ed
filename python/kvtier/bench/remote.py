"""``kvtier bench remote``: the remote tier against a raw Redis client on the same server, in one
run, on loopback. With no ``--url`` it starts its own ``redis-server`` (``valkey-server`` when
installed) and, unless ``--no-cluster``, a three-master Redis Cluster, and stops them afterwards.

- ``get_ratio_to_raw_redis`` / ``set_ratio_to_raw_redis``: time of a raw client doing plain
  ``GET``/``SET`` of the same 4 MiB values with the same pipelining (same connection code, same
  batch and in-flight window, values read straight into the caller's buffers: the raw client's
  best case) ÷ the time of kvtier's verified load / put (64-byte header + checksum on every
  object, ``SET NX``). 1.0 means the object format and checks cost nothing.
  Both ratios are best-of-repeats over best-of-repeats; ``*_median_of_rounds`` is the median
  of the per-round ratios (both clients timed back to back each round), steadier on a busy host.
- ``lookup_512_keys_ms``: ``Store.lookup`` of a 512-block prefix that only the remote tier holds
  (one pipelined batch of ``EXISTS``), best of the repeats.
- ``cluster``: the same figures against the three-master cluster.
"""

from __future__ import annotations

import functools
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

import kvtier
from kvtier.config import DramConfig, RemoteConfig
from kvtier.errors import KvtierError
from kvtier.remote import RemotePool, check_url
from kvtier.results import OMIT, Result
from kvtier.testing.redis import LocalCluster, LocalRedis

NS = bytes(range(16))
OBJECT_BYTES = 4 * 2**20


@dataclass(frozen=True)
class RemoteFigures(Result):
    """One setup's figures (a single server or a cluster): GiB/s and ratios are best of the
    repeats, ``*_median_of_rounds`` the median of each round's paired ratio."""

    get_ratio_to_raw_redis_median_of_rounds: float
    set_ratio_to_raw_redis_median_of_rounds: float
    get_ratio_to_raw_redis: float
    set_ratio_to_raw_redis: float
    kvtier_get_gib_per_s: float
    kvtier_set_gib_per_s: float
    raw_get_gib_per_s: float
    raw_set_gib_per_s: float
    lookup_512_keys_ms: float
    get_p50_s: float
    get_p99_s: float
    errors: int
    masters: int | None = field(default=None, metadata=OMIT)  # a cluster's


@dataclass(frozen=True)
class RemoteBench(Result):
    """What ``kvtier bench remote`` reports; the top-level ratios and lookup are the single server's."""

    object_bytes: int
    objects: int
    batch: int
    repeats: int
    server: str
    single: RemoteFigures
    get_ratio_to_raw_redis: float
    set_ratio_to_raw_redis: float
    lookup_512_keys_ms: float
    cluster: RemoteFigures | None = field(default=None, metadata=OMIT)


def _keys(first: int, n: int) -> bytes:
    return b"".join((first + i).to_bytes(16, "little") for i in range(n))


def _options(urls: list[str], cluster: bool) -> dict[str, Any]:
    return {"urls": urls, "cluster": cluster, "key_prefix": "kvtier-bench:"}


def _time(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class _Round:
    """One repeat: fresh keys, timed kvtier put/get and raw SET/GET of the same values."""

    def __init__(self, pool: RemotePool, objects: npt.NDArray[np.uint8], batch: int, first_key: int) -> None:
        self.pool, self.objects, self.batch = pool, objects, batch
        n = len(objects)
        ids = [list(range(first_key + i, first_key + min(i + batch, n))) for i in range(0, n, batch)]
        self.keys = [b"".join(k.to_bytes(16, "little") for k in group) for group in ids]
        # The raw client uses the very same server keys, so both spread over cluster masters alike.
        self.names = [[pool.key_name(k) for k in group] for group in ids]

    def _part(self, arr: npt.NDArray[np.uint8], b: int) -> npt.NDArray[np.uint8]:
        return arr[b * self.batch : (b + 1) * self.batch]

    def put(self) -> None:
        size = self.objects.shape[1]
        for b, k in enumerate(self.keys):
            _, _, rejected = self.pool.put(k, self._part(self.objects, b), size)
            if rejected:
                raise KvtierError(f"bench put: {rejected} objects not stored: {self.pool.metrics()}")

    def get(self, out: npt.NDArray[np.uint8]) -> None:
        for b, k in enumerate(self.keys):
            outcomes = self.pool.get(k, self._part(out, b), out.shape[1])
            if any(o != "loaded" for o in outcomes):
                raise KvtierError(f"bench get: {sorted(set(outcomes))}")

    def raw_set(self) -> None:
        size = self.objects.shape[1]
        for b, names in enumerate(self.names):
            if any(x != "ok" for x in self.pool.raw_set(names, self._part(self.objects, b), size)):
                raise KvtierError("bench raw SET failed")

    def raw_get(self, out: npt.NDArray[np.uint8]) -> None:
        for b, names in enumerate(self.names):
            if any(x != "loaded" for x in self.pool.raw_get(names, self._part(out, b), out.shape[1])):
                raise KvtierError("bench raw GET failed")

    def clean_raw(self) -> None:
        self.pool.raw_del([x for names in self.names for x in names])

    def clean_kvtier(self) -> None:
        self.pool.remove(b"".join(self.keys))


def _transfer(
    pool: RemotePool, objects: npt.NDArray[np.uint8], batch: int, repeats: int, lookup: Callable[[], float]
) -> RemoteFigures:
    """Times the rounds, then ``lookup`` (ms), and reads the pool's metrics."""
    n, size = objects.shape
    out = np.zeros_like(objects)
    raw_out = np.zeros_like(objects)
    times: dict[str, list[float]] = {"put": [], "get": [], "raw_set": [], "raw_get": []}
    for r in range(repeats):
        rd = _Round(pool, objects, batch, 1 + r * n)
        raw = [
            ("raw_set", rd.raw_set),
            ("raw_get", functools.partial(rd.raw_get, raw_out)),
            ("", rd.clean_raw),
        ]
        ours = [("put", rd.put), ("get", functools.partial(rd.get, out)), ("", rd.clean_kvtier)]
        # Alternate which goes first, so neither always meets a fresher server.
        for name, fn in raw + ours if r % 2 == 0 else ours + raw:
            seconds = _time(fn)
            if name:
                times[name].append(seconds)
    if not np.array_equal(out, objects) or not np.array_equal(raw_out, objects):
        raise KvtierError("bench read wrong bytes")
    gib = n * size / 2**30
    best = {k: min(v) for k, v in times.items()}
    # Each round times both clients back to back: the median of the per-round ratios is robust
    # to load from other processes that a ratio of two independent minimums is not.
    paired = {
        k: float(np.median([raw / ours for raw, ours in zip(times[r], times[o], strict=True)]))
        for k, r, o in (("get", "raw_get", "get"), ("set", "raw_set", "put"))
    }
    lookup_512_keys_ms = lookup()
    m = pool.metrics()
    return RemoteFigures(
        get_ratio_to_raw_redis_median_of_rounds=paired["get"],
        set_ratio_to_raw_redis_median_of_rounds=paired["set"],
        get_ratio_to_raw_redis=best["raw_get"] / best["get"],
        set_ratio_to_raw_redis=best["raw_set"] / best["put"],
        kvtier_get_gib_per_s=gib / best["get"],
        kvtier_set_gib_per_s=gib / best["put"],
        raw_get_gib_per_s=gib / best["raw_get"],
        raw_set_gib_per_s=gib / best["raw_set"],
        lookup_512_keys_ms=lookup_512_keys_ms,
        get_p50_s=m["get"]["latency_p50_s"],
        get_p99_s=m["get"]["latency_p99_s"],
        errors=sum(op["errors"] for op in (m["exists"], m["get"], m["set"], m["del"])),
    )


def _lookup_ms(urls: list[str], cluster: bool, blocks: int, repeats: int) -> float:
    """Best ``Store.lookup`` time of a ``blocks``-block prefix held only by the remote tier."""
    geometry = kvtier.Geometry(2, 2, 8, "fp16", 4)
    config = kvtier.StoreConfig(
        geometry=geometry,
        model_id="bench-lookup",
        dram=DramConfig(capacity_bytes=16 * 2**20),
        remote=RemoteConfig(urls=tuple(urls), cluster=cluster, key_prefix="kvtier-bench:"),
    )
    writer = kvtier.Store(config)
    keys = writer.namespace.block_keys(np.arange(blocks * 4, dtype=np.uint32))
    writer.put(keys, np.zeros((blocks, geometry.block_bytes), dtype=np.uint8))
    reader = kvtier.Store(config)
    best = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        hit = reader.lookup(keys).hit_blocks
        best = min(best, time.perf_counter() - start)
        if hit != blocks:
            raise KvtierError(f"bench lookup found {hit} of {blocks} blocks")
    RemotePool(_options(urls, cluster), writer.namespace.hash).remove(keys.raw)
    return float(best * 1e3)


def _measure(
    urls: list[str], cluster: bool, objects: npt.NDArray[np.uint8], batch: int, repeats: int
) -> RemoteFigures:
    pool = RemotePool(_options(urls, cluster), NS)
    return _transfer(pool, objects, batch, repeats, lambda: _lookup_ms(urls, cluster, 512, max(repeats, 5)))


@contextmanager
def _single(url: str | None) -> Iterator[tuple[str, str]]:
    if url is not None:
        yield url, "given"
        return
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-redis-") as d, LocalRedis(d) as server:
        yield server.url, f"{server.server} (started by the bench)"


@contextmanager
def _cluster(urls: list[str] | None) -> Iterator[list[str]]:
    if urls:
        yield urls
        return
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-cluster-") as d, LocalCluster(d) as c:
        yield c.urls


def run(
    url: str | None = None,
    cluster_urls: list[str] | None = None,
    cluster: bool = True,
    object_bytes: int = OBJECT_BYTES,
    objects: int = 32,
    batch: int = 16,
    repeats: int = 7,
) -> RemoteBench:
    """All figures in one run; see the module docs."""
    if objects < 1 or batch < 1 or repeats < 1 or object_bytes < 1:
        raise KvtierError("objects, batch, repeats and object_bytes must be positive")
    # A bad URL is a ConfigError that shows it without its password (never the Rust client's).
    if url is not None:
        check_url(url, "url")
    for u in cluster_urls or ():
        check_url(u, "cluster_urls")
    data = np.random.default_rng(1).integers(0, 256, (objects, object_bytes), dtype=np.uint8)
    with _single(url) as (server_url, server):
        single = _measure([server_url], False, data, batch, repeats)
    in_cluster = None
    if cluster:
        with _cluster(cluster_urls) as urls:
            in_cluster = _measure(urls, True, data, batch, repeats)
            in_cluster = replace(in_cluster, masters=len(urls) if cluster_urls else 3)
    return RemoteBench(
        object_bytes=object_bytes,
        objects=objects,
        batch=batch,
        repeats=repeats,
        server=server,
        single=single,
        get_ratio_to_raw_redis=single.get_ratio_to_raw_redis,
        set_ratio_to_raw_redis=single.set_ratio_to_raw_redis,
        lookup_512_keys_ms=single.lookup_512_keys_ms,
        cluster=in_cluster,
    )


def summary(r: RemoteBench) -> str:
    mib = r.object_bytes / 2**20
    lines = [f"remote tier vs raw Redis client, {r.objects} x {mib:g} MiB objects, batches of {r.batch}"]
    for name, s in (("single", r.single), ("cluster", r.cluster)):
        if s is None:
            continue
        lines += [
            f"  {name}: get {s.kvtier_get_gib_per_s:.2f} GiB/s vs raw {s.raw_get_gib_per_s:.2f} "
            f"(ratio {s.get_ratio_to_raw_redis:.2f}); set {s.kvtier_set_gib_per_s:.2f} vs raw "
            f"{s.raw_set_gib_per_s:.2f} (ratio {s.set_ratio_to_raw_redis:.2f}); "
            f"lookup of 512 blocks {s.lookup_512_keys_ms:.2f} ms",
        ]
    return "\n".join(lines)
