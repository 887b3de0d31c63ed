"""kvtier.DuplexEngine with its device pool on a GPU (``DuplexEngine.on_cuda``, docs/transfer.md §6).

The GPU tests need an NVIDIA GPU and the CUDA runtime; they run where ``KVTIER_GPU=1`` is set (the
device machine: see docs/transfer.md §6 for the command and the recorded run) and are skipped,
by name, elsewhere. What runs everywhere: the host engine's ``read_block`` / ``write_block``, which
the GPU tests compare against, and the refusal of a GPU engine where no CUDA runtime exists.
"""

from __future__ import annotations

import ctypes.util
import os
from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier import layout
from kvtier.errors import BufferError, ConfigError
from kvtier.transfer import DuplexEngine, TransferError, cuda_link_duplex

GPU = os.environ.get("KVTIER_GPU") == "1"
needs_gpu = pytest.mark.skipif(not GPU, reason="needs an NVIDIA GPU: set KVTIER_GPU=1 on a GPU machine")

#: 24 extra-group bytes per token: the pool has a region besides K and V.
GEOMETRY = kvtier.Geometry(4, 2, 64, "fp16", 16, extra_groups=(kvtier.ExtraGroup("state", 24),))


def engines(slots: int, blocks: int) -> list[tuple[DuplexEngine, np.ndarray]]:
    """A host engine, and a GPU engine beside it when there is a GPU."""
    out = []
    for cuda in (False, True) if GPU else (False,):
        host = np.zeros((slots, GEOMETRY.block_bytes), np.uint8)
        if cuda:
            out.append((DuplexEngine.on_cuda(GEOMETRY, blocks, host), host))
        else:
            out.append((DuplexEngine(GEOMETRY, layout.alloc_pool(GEOMETRY, blocks), host), host))
    return out


def test_write_block_then_read_block_round_trips_and_marks_the_block_dirty() -> None:
    for engine, host in engines(slots=2, blocks=3):
        data = np.random.default_rng(1).integers(0, 256, GEOMETRY.block_bytes, dtype=np.uint8)
        engine.write_block(2, data)
        assert engine.state(2) == ("dirty", None)
        assert np.array_equal(engine.read_block(2), data)
        assert not engine.read_block(1).any(), "other blocks untouched (zeroed)"
        engine.swap_out(2, 1)
        engine.submit_step()
        engine.wait_all()
        assert np.array_equal(host[1], data) and engine.state(2) == ("synced", 1)
        with pytest.raises(BufferError, match="data has 10 bytes"):
            engine.write_block(0, np.zeros(10, np.uint8))
        with pytest.raises(BufferError):
            engine.write_block(0, np.zeros(GEOMETRY.block_bytes, object))
        with pytest.raises(TransferError, match="out of range"):
            engine.read_block(3)
        engine.write_block(0, (bytes(range(256)) * 200)[: GEOMETRY.block_bytes])  # any buffer
        assert engine.read_block(0)[:3].tolist() == [0, 1, 2]
        engine.write_block(1, bytearray(GEOMETRY.block_bytes))
        # The engine's own memory is never a caller's block buffer (a torn overlapping copy).
        with pytest.raises(BufferError, match="share memory"):
            engine.write_block(0, host[1])
        with pytest.raises(BufferError, match="share memory"):
            engine._core.read_block(0, host[0])


def test_random_swaps_leave_the_same_bytes_as_a_model() -> None:
    # Random preemptions (swap-out + free), rotations, swap-ins into freed blocks and writes, in
    # steps; after each step every device block and host slot is compared with a model.
    rng = np.random.default_rng(7)
    slots = blocks = 6
    for engine, host in engines(slots, blocks):
        dev: list[np.ndarray | None] = [None] * blocks
        slot: list[np.ndarray | None] = [None] * slots
        for _step in range(60):
            outs, ins = {}, {}
            for _ in range(rng.integers(1, 5)):
                d, h = int(rng.integers(blocks)), int(rng.integers(slots))
                op = rng.integers(3)
                if d in outs or d in ins:
                    continue
                if op == 0:
                    data = rng.integers(0, 256, GEOMETRY.block_bytes, dtype=np.uint8)
                    engine.write_block(d, data)
                    dev[d] = data
                elif op == 1 and dev[d] is not None and h not in outs.values():
                    engine.swap_out(d, h)
                    outs[d] = h
                elif op == 2 and dev[d] is None and slot[h] is not None and h not in outs.values():
                    engine.swap_in(h, d)
                    ins[d] = h
            engine.submit_step()
            engine.wait_all()
            for d, h in outs.items():
                slot[h] = dev[d]
            for d, h in ins.items():
                dev[d] = slot[h]
            for d in [d for d in outs if rng.integers(2)]:
                engine.free(d)
                dev[d] = None
            for d in range(blocks):
                if dev[d] is not None:
                    assert np.array_equal(engine.read_block(d), dev[d]), f"device block {d}"
            for h in range(slots):
                if slot[h] is not None:
                    assert np.array_equal(host[h], slot[h]), f"host slot {h}"


@pytest.mark.skipif(
    GPU or ctypes.util.find_library("cudart") is not None or Path("/usr/local/cuda").exists(),
    reason="a CUDA runtime is installed here",
)
def test_without_a_cuda_runtime_a_gpu_engine_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_CUDART", "/nonexistent/libcudart.so")
    host = np.zeros((2, GEOMETRY.block_bytes), np.uint8)
    with pytest.raises(TransferError, match=r"libcudart.*KVTIER_CUDART"):
        DuplexEngine.on_cuda(GEOMETRY, 2, host)
    with pytest.raises(TransferError, match="libcudart"):
        cuda_link_duplex(2**20)


def test_bad_gpu_engine_arguments_are_named_before_any_cuda_call() -> None:
    host = np.zeros((2, GEOMETRY.block_bytes), np.uint8)
    with pytest.raises(ConfigError, match="device_blocks"):
        DuplexEngine.on_cuda(GEOMETRY, 0, host)
    with pytest.raises(ConfigError, match="device is -1"):
        DuplexEngine.on_cuda(GEOMETRY, 2, host, device=-1)
    with pytest.raises(BufferError, match="host has 10 bytes"):
        DuplexEngine.on_cuda(GEOMETRY, 2, np.zeros(10, np.uint8))
    with pytest.raises(BufferError, match="host is list"):
        DuplexEngine.on_cuda(GEOMETRY, 2, [0] * GEOMETRY.block_bytes)  # type: ignore[arg-type]


@needs_gpu
def test_gpu_engine_moves_both_directions_in_one_step_and_refuses_a_missing_device() -> None:
    engine, host = engines(4, 4)[1]
    a, b = (np.full(GEOMETRY.block_bytes, v, np.uint8) for v in (3, 5))
    host[0] = b
    engine.write_block(0, a)
    engine.swap_out(0, 1)
    engine.free(0)
    engine.swap_in(0, 0)  # into the block whose swap-out is in the same step: waits for its read
    engine.submit_step()
    engine.wait_all()
    assert np.array_equal(host[1], a) and np.array_equal(engine.read_block(0), b)
    assert engine.state(0) == ("synced", 0)
    with pytest.raises(TransferError, match="does not exist"):
        DuplexEngine.on_cuda(GEOMETRY, 2, np.zeros((2, GEOMETRY.block_bytes), np.uint8), device=4096)
    h2d, d2h, at_once = cuda_link_duplex(64 * 2**20, 3)
    assert at_once < h2d + d2h, "the link moves both directions at once faster than one after the other"


@needs_gpu
def test_a_fresh_gpu_pool_is_zeroed_before_the_first_write_lands() -> None:
    # 16 GiB of device blocks: their zeroing takes milliseconds on the legacy stream; a write
    # and a swap-in issued at once on the engine's streams must not be zeroed after landing.
    blocks = 16 * 2**30 // GEOMETRY.block_bytes
    host = np.full((2, GEOMETRY.block_bytes), 7, np.uint8)
    engine = DuplexEngine.on_cuda(GEOMETRY, blocks, host)
    data = np.full(GEOMETRY.block_bytes, 9, np.uint8)
    engine.write_block(blocks - 1, data)
    engine.swap_in(0, blocks - 2)
    engine.submit_step()
    engine.wait_all()
    assert np.array_equal(engine.read_block(blocks - 1), data)
    assert np.array_equal(engine.read_block(blocks - 2), host[0])
    assert not engine.read_block(blocks // 2).any()
