"""A panic on a transfer worker (injected with ``panic_for_test``, a ``test-hooks`` build) fails its
chunk's blocks as ``"panicked"``: ``wait`` returns the job, ``wait_layer`` raises instead of
reporting the layer in place, and the engine goes on. Each engine call runs on a thread with a
time limit, so an engine that hangs fails the test instead of the run."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import pytest

import kvtier
from kvtier import layout
from kvtier.transfer import OUTCOMES, DuplexEngine, TransferConfig, TransferEngine, TransferError

T = TypeVar("T")


def within(what: str, call: Callable[[], T], seconds: float = 60.0) -> T:
    """``call()``'s result; fails naming ``what`` if it does not return within ``seconds``."""
    box: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            box.append(call())
        except BaseException as e:  # re-raised on the test's thread
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{what}: hung (no result within {seconds} s)"
    if errors:
        raise errors[0]
    return box[0]


@pytest.fixture
def store() -> kvtier.Store:
    geometry = kvtier.Geometry(3, 2, 64, "fp16", 16)
    object_bytes = (geometry.block_bytes + 64 + 4095) // 4096 * 4096
    config = kvtier.StoreConfig(
        geometry=geometry, model_id="panics", dram=kvtier.DramConfig(capacity_bytes=32 * object_bytes)
    )
    return kvtier.Store(config)


def hooks(engine: TransferEngine) -> Callable[[str, int], None]:
    hook = getattr(engine._core, "panic_for_test", None)
    if hook is None:
        pytest.skip("this kvtier build has no test hooks (build it with `make build`)")
    return hook  # type: ignore[no-any-return]


def test_a_panicked_chunk_fails_its_blocks_and_the_engine_goes_on(store: kvtier.Store) -> None:
    geometry = store.config.geometry
    keys = store.namespace.block_keys(range(16 * 6))
    rng = np.random.default_rng(0)
    objects = rng.uniform(-2, 2, (6, geometry.block_bytes // 2)).astype(np.float16).view(np.uint8)
    store.put(keys, objects)
    engine = TransferEngine(store, TransferConfig(chunk_blocks=2, buffer_chunks=1))
    hooks(engine)("scatter", 2)  # chunk 1 panics after its layer 0 is in place
    pool = layout.alloc_pool(geometry, 6)
    job = engine.submit_load(keys, pool, range(6))
    with pytest.raises(TransferError, match="panicked"):
        within("wait_layer", lambda: engine.wait_layer(job, geometry.num_layers - 1))
    [done] = within("wait", lambda: engine.wait([job]))
    assert done.outcomes == ("done", "done", "panicked", "panicked", "done", "done")
    assert "panicked" in OUTCOMES
    assert np.array_equal(layout.gather(geometry, pool, [0, 1, 4, 5]), objects[[0, 1, 4, 5]])
    assert store.stats().leases_active == 0
    # The same load again: every block lands.
    again = layout.alloc_pool(geometry, 6)
    [ok] = within("wait after", lambda: engine.wait([engine.submit_load(keys, again, range(6))]))
    assert ok.ok and np.array_equal(layout.gather(geometry, again, range(6)), objects)
    with pytest.raises(kvtier.errors.ConfigError):
        hooks(engine)("nowhere", 1)
    # Dropping an engine cancels and drains an uncollected job whose chunk 0 panicked.
    held = [TransferEngine(store, TransferConfig(chunk_blocks=2, buffer_chunks=1))]
    hooks(held[0])("read", 1)
    held[0].submit_load(keys, layout.alloc_pool(geometry, 6), range(6))
    within("drop", held.clear)
    assert store.stats().leases_active == 0


def test_a_panicked_swap_fails_its_transfer(store: kvtier.Store) -> None:
    geometry = store.config.geometry
    device = layout.alloc_pool(geometry, 4)
    host = np.zeros((4, geometry.block_bytes), np.uint8)
    engine = DuplexEngine(geometry, device, host)
    hook = getattr(engine._core, "panic_for_test", None)
    if hook is None:
        pytest.skip("this kvtier build has no test hooks (build it with `make build`)")
    block = np.random.default_rng(1).integers(0, 256, (1, geometry.block_bytes), dtype=np.uint8)
    engine.write(0)
    layout.scatter(geometry, block, [0], device)
    hook(1)
    engine.rotate(0, 0)
    out_id, _ = engine.submit_step()
    assert out_id is not None
    with pytest.raises(TransferError, match="panicked"):
        within("duplex wait", lambda: engine.wait(out_id))
    assert engine.state(0) == ("dirty", None)
    engine.rotate(0, 0)
    out_id, _ = engine.submit_step()
    assert out_id is not None
    within("duplex wait after", lambda: engine.wait(out_id))
    assert np.array_equal(host[:1], block)
