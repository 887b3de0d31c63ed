"""A Python process writing through ``kvtier.Store`` (SSD tier, write-through) is killed with
SIGKILL mid-burst; a new store on the same directory finds every acknowledged block with
``fsync`` durability, and never returns wrong bytes in any mode."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import kvtier

GEOMETRY = kvtier.Geometry(2, 2, 64, "fp16", 16)
BLOCKS_PER_PUT = 4

WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import kvtier

    directory, durability, capacity, start = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    direct_io = sys.argv[5] == "1"
    geometry = kvtier.Geometry(2, 2, 64, "fp16", 16)
    store = kvtier.Store(kvtier.StoreConfig(
        geometry=geometry, model_id="crash", dram=kvtier.DramConfig(capacity_bytes=8 * 20480),
        ssd=kvtier.SsdConfig(directory=directory, capacity_bytes=capacity, probe_bytes=0, write_through=True,
                             durability=durability, direct_io=direct_io),
    ))
    prompt = start
    print("READY", flush=True)
    while True:
        keys = store.namespace.block_keys(range(prompt * 64, prompt * 64 + 64))
        objects = np.empty((len(keys), geometry.block_bytes), dtype=np.uint8)
        for i, k in enumerate(keys):
            objects[i] = np.random.default_rng(k & (2**64 - 1)).integers(0, 256, geometry.block_bytes, dtype=np.uint8)
        store.put(keys, objects)
        # One write per line: under PYTHONUNBUFFERED, print() writes its pieces separately and a
        # SIGKILL between them would leave a torn "ACK" line.
        sys.stdout.write(f"ACK {prompt}\\n")
        sys.stdout.flush()
        prompt += 1
    """
)


def payload(key: int) -> np.ndarray:
    return np.random.default_rng(key & (2**64 - 1)).integers(0, 256, GEOMETRY.block_bytes, dtype=np.uint8)


def write_and_kill(
    directory: Path, durability: str, capacity: int, start: int, acks: int, direct_io: bool = True
) -> list[int]:
    """Runs the writer from prompt ``start``; SIGKILLs it after ``acks`` acknowledged puts."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            WRITER,
            str(directory),
            durability,
            str(capacity),
            str(start),
            str(int(direct_io)),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    acked: list[int] = []
    deadline = time.monotonic() + 120
    for line in child.stdout:
        if line.startswith("ACK ") and line.endswith("\n"):
            acked.append(int(line.split()[1]))
            if len(acked) >= acks:
                break
        assert time.monotonic() < deadline, "writer too slow"
    assert len(acked) >= acks, "writer exited early"
    time.sleep(0.003 * (start % 5))  # land the kill at different points of the next put
    child.send_signal(signal.SIGKILL)
    rest, _ = child.communicate()
    # Whole lines only (a line the kill cut short was never acknowledged).
    acked += [int(line.split()[1]) for line in rest.split("\n")[:-1] if line.startswith("ACK ")]
    assert child.returncode == -signal.SIGKILL
    return acked


def reopen(directory: Path, durability: str, capacity: int) -> kvtier.Store:
    return kvtier.Store(
        kvtier.StoreConfig(
            geometry=GEOMETRY,
            model_id="crash",
            dram=kvtier.DramConfig(capacity_bytes=8 * 20480),
            ssd=kvtier.SsdConfig(
                directory=str(directory), capacity_bytes=capacity, probe_bytes=0, durability=durability
            ),
        )
    )


def check_prompt(store: kvtier.Store, prompt: int) -> int:
    """Loads a prompt's hit prefix; asserts every loaded byte is right; returns the hit count."""
    keys = store.namespace.block_keys(range(prompt * 64, prompt * 64 + 64))
    with store.lease(keys) as lease:
        out = np.zeros((lease.hit_blocks, GEOMETRY.block_bytes), dtype=np.uint8)
        loaded = store.load(lease, out).loaded_blocks
    for i in range(loaded):
        assert np.array_equal(out[i], payload(keys[i])), (
            f"prompt {prompt} block {i}: WRONG bytes after a crash"
        )
    return loaded


def test_fsync_every_acknowledged_block_survives_sigkill(tmp_path: Path) -> None:
    capacity = 64 * 2**20  # no eviction: every acknowledged block must be there
    start = 0
    acked: list[int] = []
    for round_ in range(3):
        acked += write_and_kill(tmp_path, "fsync", capacity, start, acks=3 + round_)
        store = reopen(tmp_path, "fsync", capacity)
        metrics = store.ssd_metrics()
        assert metrics is not None and metrics["evictions"] == 0
        for prompt in acked:
            assert check_prompt(store, prompt) == BLOCKS_PER_PUT, (
                f"round {round_}: acknowledged prompt {prompt} lost"
            )
        check_prompt(store, max(acked) + 1)  # maybe partly written: whatever loads must be right
        store.check_integrity()
        del store
        start = max(acked) + 2


@pytest.mark.parametrize(("durability", "direct_io"), [("none", True), ("fsync", True), ("none", False)])
def test_never_wrong_bytes_with_eviction(tmp_path: Path, durability: str, direct_io: bool) -> None:
    """Also with ``direct_io=False``: write-through into the page cache, read back with O_DIRECT."""
    capacity = 48 * GEOMETRY.block_bytes  # constant SSD eviction and extent reuse
    start = 0
    for _ in range(2):
        acked = write_and_kill(tmp_path, durability, capacity, start, acks=15, direct_io=direct_io)
        store = reopen(tmp_path, durability, capacity)
        store.check_integrity()
        hits = sum(check_prompt(store, p) for p in range(start, max(acked) + 2))
        assert hits > 0
        assert check_prompt(store, max(acked)) == BLOCKS_PER_PUT  # the newest acknowledged put
        del store
        start = max(acked) + 2
    assert os.path.exists(tmp_path / "index.log")
