"""Prometheus metrics of running stores, under ``kvtier_`` names (docs/metrics.md).

``StoreConfig(metrics_port=9464)`` serves ``/metrics`` for the store on that port (loopback by
default, ``metrics_addr`` to change it); several stores of one process may name the same port and
are told apart by their ``namespace`` label (two live stores of one namespace: ``<hex>``,
``<hex>-2``). Values are read from the store's own counters when
Prometheus scrapes (:meth:`Store.stats`, :meth:`Store.tier_stats`, :meth:`Store.ssd_metrics`,
:meth:`Store.remote_metrics`): nothing is added to the store's hot paths, and a store that is
gone (garbage-collected) leaves the scrape.

Labels: ``namespace`` (the first 8 bytes of the store's namespace hash, hex: never the model id,
a URL or a password), ``tier`` (dram, ssd, remote), ``device`` (the SSD device's index), ``op``
(exists, get, set, del), ``stage`` (the transfer engine's read, decompress, dequantize,
scatter; counters summed over every engine the store had, collected ones included, so that
they never go back), ``quantile`` (0.5, 0.99: latencies are the tiers' own p50/p99, exported
as gauges). :data:`METRICS` is the one list of every metric; docs/metrics.md is checked against it.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvtier.errors import ConfigError
from kvtier.keys import Namespace

if TYPE_CHECKING:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from kvtier._core import RemoteMetrics, SsdMetrics


class Store(Protocol):
    """What the metrics read of a :class:`kvtier.store.Store` (which imports this module)."""

    namespace: Namespace

    def stats(self) -> Any: ...
    def tier_stats(self) -> Mapping[str, Any]: ...
    def ssd_metrics(self) -> SsdMetrics | None: ...
    def remote_metrics(self) -> RemoteMetrics | None: ...


class Engine(Protocol):
    """What the metrics read of a :class:`kvtier.transfer.TransferEngine` (which imports this)."""

    store: Any

    def stage_stats(self) -> Sequence[Any]: ...  # name, workers, busy_s, bytes, chunks, stored_bytes
    def jobs(self) -> int: ...


@dataclass(frozen=True)
class Metric:
    """One exported metric: its name (``kvtier_`` + name, counters end in ``_total``), kind,
    labels beyond ``namespace``, and help text."""

    name: str
    kind: str  # "counter" | "gauge"
    labels: tuple[str, ...]
    help: str


def _store_metrics() -> list[Metric]:
    help_ = {
        "lookups": "lookups (one per lookup, lookup_each or lease call)",
        "hit_blocks": "blocks found by lookups",
        "miss_blocks": "blocks lookups did not find",
        "put_blocks": "blocks put",
        "put_bytes": "bytes put",
        "loaded_blocks": "blocks loaded and verified",
        "loaded_bytes": "bytes loaded and verified",
        "evictions": "blocks evicted from DRAM",
        "rejected_puts": "blocks no tier took",
        "checksum_failures": "stored copies that failed verification (never served)",
        "leases_expired": "leases reclaimed after their TTL",
        "demoted_blocks": "blocks DRAM gave up that are in the SSD tier",
        "admission_skipped": "blocks DRAM gave up under the SSD admission threshold",
        "demotion_failed": "blocks the SSD tier refused on demotion",
        "promoted_blocks": "blocks copied up into DRAM on a hit below it",
        "written_through": "blocks written to SSD at put time",
        "dropped_evictions": "blocks DRAM evicted without trying SSD",
        "remote_written": "blocks written to the remote tier",
        "remote_write_failed": "blocks the remote tier did not take",
        "load_missing": "leased blocks gone when loaded (misses)",
    }
    out = [Metric(f"store_{k}_total", "counter", (), v) for k, v in help_.items()]
    out.append(Metric("store_leases_active", "gauge", (), "leases held now"))
    return out


#: StoreStats fields exported (the codec byte counters are in the tier metrics' encoded rows).
STORE_FIELDS = tuple(m.name[len("store_") : -len("_total")] for m in _store_metrics() if m.kind == "counter")
TIER_GAUGES = ("objects", "pinned_objects", "doomed_objects", "used_bytes", "capacity_bytes")
TIER_COUNTERS = ("stored", "evictions", "rejected", "checksum_failures")
SSD_DEVICE_COUNTERS = ("bytes_read", "bytes_written", "read_ops", "write_ops", "io_errors")
SSD_DEVICE_GAUGES = ("queue_depth", "queue_depth_max", "used_bytes", "capacity_bytes", "objects")
#: StageStats field -> help; summed over the store's engines per stage (bytes: decoded block bytes;
#: stored_bytes: bytes as the tiers hold them, read stage only).
TRANSFER_STAGE_COUNTERS = {
    "busy_seconds": "busy time, all workers",
    "bytes": "block bytes processed",
    "chunks": "chunks processed",
    "stored_bytes": "bytes read as the tiers store them (read stage)",
}
REMOTE_OP_COUNTERS = ("batches", "keys", "bytes", "errors")
REMOTE_FAULTS = (
    "connects", "reconnects", "connect_failures", "auth_failures", "down_misses",
    "down_skipped_writes", "missing_on_get", "bad_magic", "bad_length", "bad_checksum",
    "foreign_objects", "redirects", "slot_refreshes",
)  # fmt: skip

METRICS: tuple[Metric, ...] = (
    *_store_metrics(),
    *(Metric(f"tier_{f}", "gauge", ("tier",), f"{f.replace('_', ' ')} per tier") for f in TIER_GAUGES),
    *(
        Metric(f"tier_{f}_total", "counter", ("tier",), f"{f.replace('_', ' ')} per tier")
        for f in TIER_COUNTERS
    ),
    *(
        Metric(f"ssd_device_{f}_total", "counter", ("device",), f"SSD device {f.replace('_', ' ')}")
        for f in SSD_DEVICE_COUNTERS
    ),
    *(
        Metric(f"ssd_device_{f}", "gauge", ("device",), f"SSD device {f.replace('_', ' ')}")
        for f in SSD_DEVICE_GAUGES
    ),
    Metric("ssd_device_latency_seconds", "gauge", ("device", "op", "quantile"), "SSD read/write latency"),
    *(
        Metric(f"remote_{f}_total", "counter", ("op",), f"remote {f} per operation")
        for f in REMOTE_OP_COUNTERS
    ),
    Metric("remote_latency_seconds", "gauge", ("op", "quantile"), "remote batch latency"),
    *(
        Metric(f"remote_{f}_total", "counter", (), f"remote tier: {f.replace('_', ' ')}")
        for f in REMOTE_FAULTS
    ),
    Metric("remote_nodes", "gauge", (), "remote server nodes known"),
    Metric("remote_nodes_down", "gauge", (), "remote server nodes marked down"),
    Metric("transfer_engines", "gauge", (), "transfer engines built on the store"),
    Metric("transfer_jobs", "gauge", (), "transfer jobs not yet collected, over those engines"),
    *(
        Metric(f"transfer_stage_{f}_total", "counter", ("stage",), f"transfer engine stage {what}")
        for f, what in TRANSFER_STAGE_COUNTERS.items()
    ),
    Metric("transfer_stage_workers", "gauge", ("stage",), "transfer engine stage workers"),
)
_BY_NAME = {m.name: m for m in METRICS}


def namespace_label(store: Store) -> str:
    return store.namespace.hash[:8].hex()


def _number(values: Mapping[str, object], key: str) -> float:
    """``values[key]`` of a metrics dict looked up by a name from the lists above."""
    value = values[key]
    assert isinstance(value, int | float), f"metric {key} is {value!r}"
    return float(value)


def samples(store: Store) -> Iterator[tuple[str, dict[str, str], float]]:
    """Every sample of one store: (metric name without ``kvtier_``, labels, value)."""
    stats = store.stats()
    for f in STORE_FIELDS:
        yield f"store_{f}_total", {}, float(getattr(stats, f))
    yield "store_leases_active", {}, float(stats.leases_active)
    for tier, ts in store.tier_stats().items():
        for f in TIER_GAUGES:
            yield f"tier_{f}", {"tier": tier}, float(getattr(ts, f))
        for f in TIER_COUNTERS:
            yield f"tier_{f}_total", {"tier": tier}, float(getattr(ts, f))
    ssd = store.ssd_metrics()
    for i, dev in enumerate(ssd["devices"] if ssd else ()):
        device = {"device": str(i)}
        for f in SSD_DEVICE_COUNTERS:
            yield f"ssd_device_{f}_total", device, _number(dev, f)
        for f in SSD_DEVICE_GAUGES:
            yield f"ssd_device_{f}", device, _number(dev, f)
        for op in ("read", "write"):
            for q, key in (("0.5", "p50"), ("0.99", "p99")):
                labels = {**device, "op": op, "quantile": q}
                yield "ssd_device_latency_seconds", labels, _number(dev, f"{op}_{key}_s")
    remote = store.remote_metrics()
    if remote:
        ops = (
            ("exists", remote["exists"]),
            ("get", remote["get"]),
            ("set", remote["set"]),
            ("del", remote["del"]),
        )
        for op, values in ops:
            for f in REMOTE_OP_COUNTERS:
                yield f"remote_{f}_total", {"op": op}, _number(values, f)
            for q, key in (("0.5", "p50"), ("0.99", "p99")):
                yield (
                    "remote_latency_seconds",
                    {"op": op, "quantile": q},
                    _number(values, f"latency_{key}_s"),
                )
        for f in REMOTE_FAULTS:
            yield f"remote_{f}_total", {}, _number(remote, f)
        yield "remote_nodes", {}, float(remote["nodes"])
        yield "remote_nodes_down", {}, float(remote["nodes_down"])
    yield from _transfer_samples(store)


_engines: weakref.WeakSet[Engine] = weakref.WeakSet()
_engines_lock = threading.Lock()
#: Per store, the stage counters of its engines that are gone: they stay in the totals, so that a
#: counter never goes back when an engine is collected (Prometheus would read a reset).
_retired: weakref.WeakKeyDictionary[Store, dict[str, dict[str, float]]] = weakref.WeakKeyDictionary()
#: Engines' last counters, appended as they are collected and folded into :data:`_retired` by the
#: next scrape (a collection may run inside a scrape, under the lock: the append takes none).
_retiring: deque[tuple[weakref.ref[Store], list[Any]]] = deque()
_STAGE_ROW = ("workers", *TRANSFER_STAGE_COUNTERS)


def watch_engine(engine: Engine, stage_stats: Callable[[], Sequence[Any]]) -> None:
    """Exports `engine`'s stage statistics with its store's metrics: while it lives, and its
    counters' last values after it is collected. ``stage_stats`` reads them as
    ``engine.stage_stats()`` does, without holding the engine."""
    with _engines_lock:
        _engines.add(engine)
    store = weakref.ref(engine.store)
    weakref.finalize(engine, lambda: _retiring.append((store, list(stage_stats())))).atexit = False


def _add_stages(totals: dict[str, dict[str, float]], stages: Iterable[Any], workers: bool) -> None:
    for st in stages:
        row = totals.setdefault(st.name, dict.fromkeys(_STAGE_ROW, 0.0))
        row["workers"] += st.workers if workers else 0
        row["busy_seconds"] += st.busy_s
        row["bytes"] += st.bytes
        row["chunks"] += st.chunks
        row["stored_bytes"] += st.stored_bytes


def _transfer_samples(store: Store) -> Iterator[tuple[str, dict[str, str], float]]:
    with _engines_lock:
        while _retiring:
            owner, stages = _retiring.popleft()
            if (alive := owner()) is not None:
                _add_stages(_retired.setdefault(alive, {}), stages, workers=False)
        engines = [e for e in _engines if e.store is store]
        totals = {stage: dict(row) for stage, row in _retired.get(store, {}).items()}
    yield "transfer_engines", {}, float(len(engines))
    yield "transfer_jobs", {}, float(sum(e.jobs() for e in engines))
    for engine in engines:
        _add_stages(totals, engine.stage_stats(), workers=True)
    for stage, row in totals.items():
        for f in TRANSFER_STAGE_COUNTERS:
            yield f"transfer_stage_{f}_total", {"stage": stage}, row[f]
        yield "transfer_stage_workers", {"stage": stage}, row["workers"]


class StoreCollector:
    """A prometheus_client collector over the stores registered with it (weakly held)."""

    def __init__(self) -> None:
        #: Each store's ``namespace`` label (see :meth:`add`).
        self._stores: weakref.WeakKeyDictionary[Store, str] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def add(self, store: Store) -> str:
        """Registers `store`; returns its ``namespace`` label: :func:`namespace_label`, or, while
        another live store of this endpoint has that one (the same namespace: two samples with
        one label set would be one series with two values), the first free ``<label>-<n>``."""
        with self._lock:
            if store not in self._stores:
                base, taken = namespace_label(store), set(self._stores.values())
                label = base
                for n in itertools.count(2):
                    if label not in taken:
                        break
                    label = f"{base}-{n}"
                self._stores[store] = label
            return self._stores[store]

    def stores(self) -> list[Store]:
        """The live stores it exports."""
        with self._lock:
            return list(self._stores)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for m in METRICS:
            labels = ["namespace", *m.labels]
            if m.kind == "counter":  # prometheus_client appends `_total` itself
                families[m.name] = CounterMetricFamily(
                    f"kvtier_{m.name[: -len('_total')]}", m.help, labels=labels
                )
            else:
                families[m.name] = GaugeMetricFamily(f"kvtier_{m.name}", m.help, labels=labels)
        with self._lock:
            stores = list(self._stores.items())
        for store, ns in stores:
            for name, sample_labels, value in samples(store):
                m = _BY_NAME[name]
                families[name].add_metric([ns, *(sample_labels[k] for k in m.labels)], value)
        yield from families.values()


@dataclass(frozen=True)
class _Endpoint:
    """One ``/metrics`` HTTP server of this process and the stores it exports."""

    collector: StoreCollector
    server: Any  # prometheus_client's WSGI server
    thread: threading.Thread


_servers: dict[tuple[str, int], _Endpoint] = {}
_servers_lock = threading.Lock()
#: The name of the thread that closes an endpoint whose stores are gone (tests wait for it).
CLOSER_THREAD = "kvtier-metrics-close"


def serve(store: Store, port: int, addr: str = "127.0.0.1") -> str:
    """Exports `store` on ``http://addr:port/metrics`` (starting the endpoint on first use of
    that address in this process, and closing it once every store it exports is collected);
    returns its ``namespace`` label there (:meth:`StoreCollector.add`).
    Raises ConfigError naming `metrics_port` and `metrics_addr` when it cannot bind there."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as e:
        raise ConfigError(
            "`metrics_port` needs the prometheus_client package (pip install prometheus_client)"
        ) from e
    with _servers_lock:
        endpoint = _servers.get((addr, port))
        if endpoint is None:
            collector = StoreCollector()
            registry = CollectorRegistry(auto_describe=False)
            registry.register(collector)
            try:
                server, thread = start_http_server(port, addr=addr, registry=registry)
            except OSError as e:
                raise ConfigError(
                    f"`metrics_port` {port} on `metrics_addr` {addr!r}: cannot serve metrics there ({e})"
                ) from e
            endpoint = _servers[(addr, port)] = _Endpoint(collector, server, thread)
        label = endpoint.collector.add(store)
    # A store may be collected anywhere (inside a scrape, or here under the lock): the endpoint is
    # looked at, and closed if no store is left, on a thread of its own.
    closer = threading.Thread(target=_close_if_unused, args=((addr, port),), name=CLOSER_THREAD, daemon=True)
    weakref.finalize(store, closer.start).atexit = False
    return label


def _close_if_unused(where: tuple[str, int]) -> None:
    """Stops and closes the endpoint at `where` (its port is free again) if it exports no live
    store; under the lock, so that a store opening there meanwhile finds it open or finds none."""
    with _servers_lock:
        endpoint = _servers.get(where)
        if endpoint is None or endpoint.collector.stores():
            return
        del _servers[where]
        endpoint.server.shutdown()
        endpoint.server.server_close()
        endpoint.thread.join()


def parse(text: str) -> Mapping[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A scrape's samples as {(name, sorted labels): value} (``kvtier top`` and the tests)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out
