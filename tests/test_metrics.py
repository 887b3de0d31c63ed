"""Prometheus metrics (kvtier.metrics): a real store with DRAM, SSD and a real Redis tier serves
/metrics over HTTP; scrapes move with real traffic and never leak a URL or a password."""

from __future__ import annotations

import gc
import json
import re
import socket
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import DramConfig, RemoteConfig, SsdConfig, Store, StoreConfig, layout
from kvtier.errors import ConfigError
from kvtier.geometry import Geometry
from kvtier.keys import block_keys
from kvtier.metrics import CLOSER_THREAD, METRICS, namespace_label, parse
from kvtier.testing.redis import LocalRedis, free_port
from kvtier.transfer import TransferEngine

ROOT = Path(__file__).resolve().parents[1]
GEOMETRY = Geometry(num_layers=2, num_kv_heads=2, head_dim=16, dtype="fp16", block_tokens=16)
PASSWORD = "s3cret-pw"


def store_on_free_port(make: Callable[[int], StoreConfig]) -> Store:
    """A store serving metrics on a port that was free (another process may take it between the
    pick and the bind: try again on another)."""
    for _ in range(5):
        try:
            return Store(make(free_port()))
        except ConfigError as e:
            if "cannot serve metrics" not in str(e):
                raise
    raise AssertionError("no free port for the metrics endpoint in 5 tries")


def scrape(store: Store) -> tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    port = store.config.metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return text, dict(parse(text))


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    matches = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(matches) == 1, f"{name} {labels}: {len(matches)} samples"
    return matches[0]


def test_scrape_of_a_store_with_every_tier_moves_with_real_traffic(tmp_path: Path) -> None:
    (tmp_path / "ssd").mkdir()
    with LocalRedis(tmp_path / "redis", password=PASSWORD) as redis:
        store = store_on_free_port(
            lambda port: StoreConfig(
                geometry=GEOMETRY, model_id="metrics-test", dram=DramConfig(capacity_bytes="1MiB"),
                ssd=SsdConfig(directory=str(tmp_path / "ssd"), capacity_bytes="16MiB", write_through=True,
                              probe_bytes=0),
                remote=RemoteConfig(urls=(redis.url,)), metrics_port=port,
            )
        )  # fmt: skip
        ns = namespace_label(store)
        text0, before = scrape(store)
        tokens = np.arange(16 * 8, dtype=np.uint32)
        keys = block_keys(store.namespace, tokens)
        objects = np.random.default_rng(0).integers(0, 255, (8, GEOMETRY.block_bytes), dtype=np.uint8)
        store.put(keys, objects)
        out = np.zeros_like(objects)
        with store.lease(keys) as lease:
            store.load(lease, out)
        assert np.array_equal(out, objects)
        engine = TransferEngine(store)  # its stages join the store's metrics
        pool = layout.alloc_pool(GEOMETRY, 8)
        [job] = engine.wait([engine.submit_load(keys, pool, range(8))])
        assert job.done_blocks == 8
        text1, after = scrape(store)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, namespace=ns, **labels) - value(before, name, namespace=ns, **labels)

    assert delta("kvtier_store_put_blocks_total") == 8
    assert delta("kvtier_store_put_bytes_total") == 8 * GEOMETRY.block_bytes
    assert delta("kvtier_store_hit_blocks_total") == 16  # 8 by store.load, 8 by the engine's job
    assert delta("kvtier_store_loaded_blocks_total") == 16
    assert value(after, "kvtier_store_leases_active", namespace=ns) == 0
    assert delta("kvtier_tier_objects", tier="dram") == 8
    assert delta("kvtier_tier_used_bytes", tier="dram") > 0
    assert value(after, "kvtier_tier_capacity_bytes", tier="dram", namespace=ns) == 2**20
    assert delta("kvtier_tier_stored_total", tier="ssd") == 8
    assert delta("kvtier_ssd_device_bytes_written_total", device="0") >= 8 * GEOMETRY.block_bytes
    assert delta("kvtier_remote_keys_total", op="set") == 8
    assert delta("kvtier_remote_bytes_total", op="set") >= 8 * GEOMETRY.block_bytes
    assert value(after, "kvtier_remote_connects_total", namespace=ns) >= 1
    assert value(after, "kvtier_remote_latency_seconds", op="set", quantile="0.99", namespace=ns) > 0
    assert value(after, "kvtier_transfer_engines", namespace=ns) == 1
    for stage in ("read", "scatter"):
        assert (
            value(after, "kvtier_transfer_stage_bytes_total", stage=stage, namespace=ns)
            == 8 * GEOMETRY.block_bytes
        )
        assert value(after, "kvtier_transfer_stage_busy_seconds_total", stage=stage, namespace=ns) > 0
    assert value(after, "kvtier_transfer_stage_workers", stage="read", namespace=ns) >= 1
    assert value(before, "kvtier_transfer_engines", namespace=ns) == 0
    for text in (text0, text1):
        assert PASSWORD not in text and "redis://" not in text and "metrics-test" not in text
        assert str(tmp_path) not in text  # SSD device paths stay out too


def test_two_stores_share_a_port_and_a_dropped_store_leaves_the_scrape(tmp_path: Path) -> None:
    first = store_on_free_port(
        lambda port: StoreConfig(
            geometry=GEOMETRY, model_id="a", dram=DramConfig(capacity_bytes="1MiB"), metrics_port=port
        )
    )
    second = Store(
        StoreConfig(
            geometry=GEOMETRY,
            model_id="b",
            dram=DramConfig(capacity_bytes="1MiB"),
            metrics_port=first.config.metrics_port,
        )
    )
    _, samples = scrape(first)
    names = {dict(ls)["namespace"] for (n, ls), _ in samples.items() if n == "kvtier_store_lookups_total"}
    assert names == {namespace_label(first), namespace_label(second)}
    gone = namespace_label(second)
    del second
    gc.collect()
    _, samples = scrape(first)
    assert all(dict(ls).get("namespace") != gone for (_, ls) in samples)


def test_two_live_stores_of_one_namespace_are_two_series() -> None:
    # One label set with two values would be one series that jumps between two stores' counters.
    def config(port: int) -> StoreConfig:
        return StoreConfig(
            geometry=GEOMETRY, model_id="twin", dram=DramConfig(capacity_bytes="1MiB"), metrics_port=port
        )

    first = store_on_free_port(config)
    second = Store(config(first.config.metrics_port or 0))
    ns = namespace_label(first)
    keys = block_keys(first.namespace, np.arange(16 * 2, dtype=np.uint32))
    first.put(keys, np.zeros((2, GEOMETRY.block_bytes), np.uint8))
    text, samples = scrape(first)
    assert text.count("kvtier_store_put_blocks_total{") == 2
    assert value(samples, "kvtier_store_put_blocks_total", namespace=ns) == 2
    assert value(samples, "kvtier_store_put_blocks_total", namespace=f"{ns}-2") == 0
    assert (first.metrics_label, second.metrics_label) == (ns, f"{ns}-2")
    del first
    gc.collect()
    third = Store(config(second.config.metrics_port or 0))  # the label that is free again
    assert third.metrics_label == ns and second.metrics_label == f"{ns}-2"


def test_transfer_stage_counters_never_go_back_when_an_engine_is_collected() -> None:
    store = store_on_free_port(
        lambda port: StoreConfig(
            geometry=GEOMETRY, model_id="engines", dram=DramConfig(capacity_bytes="1MiB"), metrics_port=port
        )
    )
    ns = namespace_label(store)
    keys = block_keys(store.namespace, np.arange(16 * 4, dtype=np.uint32))
    store.put(keys, np.ones((4, GEOMETRY.block_bytes), np.uint8))
    engines = [TransferEngine(store), TransferEngine(store)]
    for engine in engines:
        [job] = engine.wait([engine.submit_load(keys, layout.alloc_pool(GEOMETRY, 4), range(4))])
        assert job.ok
    _, before = scrape(store)
    del engine, engines[0]
    gc.collect()
    _, after = scrape(store)
    assert value(after, "kvtier_transfer_engines", namespace=ns) == 1
    for stage in ("read", "scatter"):
        counted = value(before, "kvtier_transfer_stage_bytes_total", stage=stage, namespace=ns)
        assert counted == 2 * 4 * GEOMETRY.block_bytes
        assert value(after, "kvtier_transfer_stage_bytes_total", stage=stage, namespace=ns) == counted
        assert value(after, "kvtier_transfer_stage_workers", stage=stage, namespace=ns) == 1  # alive only
    del engines
    gc.collect()
    _, gone = scrape(store)
    assert value(gone, "kvtier_transfer_engines", namespace=ns) == 0
    assert value(gone, "kvtier_transfer_stage_chunks_total", stage="read", namespace=ns) == value(
        before, "kvtier_transfer_stage_chunks_total", stage="read", namespace=ns
    )


def test_every_declared_metric_is_exported_and_no_other(tmp_path: Path) -> None:
    (tmp_path / "ssd").mkdir()
    with LocalRedis(tmp_path / "redis") as redis:
        store = store_on_free_port(
            lambda port: StoreConfig(
                geometry=GEOMETRY, model_id="all", dram=DramConfig(capacity_bytes="1MiB"),
                ssd=SsdConfig(directory=str(tmp_path / "ssd"), capacity_bytes="16MiB", probe_bytes=0),
                remote=RemoteConfig(urls=(redis.url,)), metrics_port=port,
            )
        )  # fmt: skip
        engine = TransferEngine(store)  # noqa: F841  # alive during the scrape: its stages are exported
        _, samples = scrape(store)
    exported = {n for (n, ls), _ in samples.items() if n.startswith("kvtier_")}
    declared = {f"kvtier_{m.name}" for m in METRICS}
    assert exported == declared


@pytest.mark.parametrize("port", [0, 70000, True, "9464"])
def test_bad_metrics_port_is_a_config_error_naming_the_key(port: object) -> None:
    with pytest.raises(ConfigError, match="metrics_port"):
        StoreConfig(geometry=GEOMETRY, model_id="bad", metrics_port=port)  # type: ignore[arg-type]


def test_a_port_taken_by_another_program_is_a_config_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"`metrics_port` {port}"):
            Store(
                StoreConfig(
                    geometry=GEOMETRY,
                    model_id="taken",
                    dram=DramConfig(capacity_bytes="1MiB"),
                    metrics_port=port,
                )
            )


def wait_for_closers() -> None:
    """Joins the threads that close endpoints whose stores are gone."""
    for thread in threading.enumerate():
        if thread.name == CLOSER_THREAD:
            thread.join()


def test_an_endpoint_closes_once_its_last_store_is_collected() -> None:
    def config(port: int) -> StoreConfig:
        return StoreConfig(
            geometry=GEOMETRY, model_id="closing", dram=DramConfig(capacity_bytes="1MiB"), metrics_port=port
        )

    first = store_on_free_port(config)
    port = first.config.metrics_port or 0
    second = Store(config(port))
    del first
    gc.collect()
    wait_for_closers()
    scrape(second)  # one store is left: still served
    del second
    gc.collect()
    wait_for_closers()
    with socket.socket() as probe:  # the port is free again (it stayed bound for the process's life)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: past TIME_WAIT
        probe.bind(("127.0.0.1", port))
        probe.listen()
    third = Store(config(port))  # and a store opens an endpoint there again
    _, samples = scrape(third)
    assert value(samples, "kvtier_store_put_blocks_total", namespace=namespace_label(third)) == 0


@pytest.mark.parametrize("addr", ["no-such-host.invalid", "999.1.1.1", " 127.0.0.1"])
def test_an_address_that_cannot_be_bound_is_a_config_error_naming_it(addr: str) -> None:
    with pytest.raises(ConfigError, match=rf"`metrics_port` \d+ on `metrics_addr` {re.escape(repr(addr))}: "):
        Store(
            StoreConfig(
                geometry=GEOMETRY,
                dram=DramConfig(capacity_bytes="1MiB"),
                metrics_port=free_port(),
                metrics_addr=addr,
            )
        )


def test_docs_list_every_metric_and_the_dashboard_queries_only_real_ones() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    listed = set(re.findall(r"`(kvtier_[a-z0-9_]+)`", doc))
    declared = {f"kvtier_{m.name}" for m in METRICS}
    assert declared - listed == set(), "metrics missing from docs/metrics.md"
    assert listed - declared == set(), "docs/metrics.md lists metrics that do not exist"
    dashboard = json.loads((ROOT / "docs" / "grafana-kvtier.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    used = {n for e in exprs for n in re.findall(r"kvtier_[a-z0-9_]+", e)}
    assert used and used <= declared, f"dashboard queries unknown metrics {sorted(used - declared)}"


def dashboard_unit(panel: dict[str, Any], ref_id: str) -> str:
    """The unit Grafana shows target `ref_id` of `panel` in: its override, or the panel's."""
    config = panel["fieldConfig"]
    for override in config.get("overrides", []):
        if override["matcher"] == {"id": "byFrameRefID", "options": ref_id}:
            units = [p["value"] for p in override["properties"] if p["id"] == "unit"]
            if units:
                return str(units[0])
    return str(config["defaults"]["unit"])


def test_the_dashboard_shows_each_query_in_its_unit_and_never_divides_by_zero() -> None:
    dashboard = json.loads((ROOT / "docs" / "grafana-kvtier.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr, where = target["expr"], f"{panel['title']!r} {target['refId']}"
            if "/" in expr:  # a ratio: its denominator is kept from 0 (no NaN/+Inf for an empty tier)
                expected = "percentunit"
                assert "clamp_min(" in expr or "> 0)" in expr, f"{where} may divide by zero: {expr}"
            elif "_seconds" in expr and "rate(" not in expr:
                expected = "s"
            elif re.search(r"rate\(kvtier_\w*bytes\w*_total", expr):
                expected = "Bps"
            elif "rate(" in expr:
                expected = "ops"
            else:
                expected = "short"
            assert dashboard_unit(panel, target["refId"]) == expected, f"{where}: {expr}"
