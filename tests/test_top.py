"""`kvtier top` (kvtier.top): the real CLI reads a real store's metrics endpoint while the store
serves traffic, and shows its tiers, hit rate and bandwidth."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from kvtier import DramConfig, SsdConfig, Store, StoreConfig, layout
from kvtier.geometry import Geometry
from kvtier.metrics import namespace_label
from kvtier.testing.redis import free_port
from kvtier.testing.traffic import store_traffic
from kvtier.transfer import TransferEngine

GEOMETRY = Geometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", block_tokens=16)


def test_top_once_shows_tiers_hit_rate_and_bandwidth_of_a_busy_store(tmp_path: Path) -> None:
    (tmp_path / "ssd").mkdir()
    store = None
    for _ in range(5):  # the picked port may be taken before the store binds it
        port = free_port()
        try:
            store = Store(
                StoreConfig(
                    geometry=GEOMETRY, model_id="top", dram=DramConfig(capacity_bytes="4MiB"),
                    ssd=SsdConfig(directory=str(tmp_path / "ssd"), capacity_bytes="16MiB", write_through=True,
                                  probe_bytes=0),
                    metrics_port=port,
                )
            )  # fmt: skip
            break
        except Exception as e:
            if "cannot serve metrics" not in str(e):
                raise
    assert store is not None
    stop = threading.Event()
    engine, pool = TransferEngine(store), layout.alloc_pool(GEOMETRY, 4)
    worker = threading.Thread(target=store_traffic, args=(store, engine, pool, stop))
    worker.start()
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        proc = subprocess.run(
            [sys.executable, "-m", "kvtier.cli", "top", url, "--once", "--interval", "1"],
            capture_output=True, text=True, timeout=60, env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
    finally:
        stop.set()
        worker.join()
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    ns = namespace_label(store)
    assert "kvtier stores" in text and ns in text, text
    dram = next(line for line in text.splitlines() if ns in line and "dram" in line)
    cells = [c.strip() for c in dram.split("│")[1:-1]]
    assert cells[:2] == [ns, "dram"], cells
    # Each round leases 4 stored blocks (hits) and looks up 4 others (misses); a scrape may cut a
    # round in two, so the rate over the second is 50% give or take a round.
    assert cells[4].endswith("%") and 40 <= int(cells[4][:-1]) <= 60, cells
    assert cells[5].endswith("/s") and not cells[5].startswith("0 B"), cells  # put bandwidth
    assert cells[6].endswith("/s") and not cells[6].startswith("0 B"), cells  # loaded bandwidth
    assert "SSD devices" in text and "ssd" in text
    assert "transfer engines" in text, text
    for stage in ("read", "scatter"):
        row = next(line for line in text.splitlines() if ns in line and f" {stage} " in line and "/s" in line)
        cells = [c.strip() for c in row.split("│")[1:-1]]
        assert cells[1] == stage and int(cells[2]) >= 1 and not cells[4].startswith("0 B"), cells


def test_top_names_the_url_it_cannot_read() -> None:
    url = f"http://127.0.0.1:{free_port()}/metrics"
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "top", url, "--once", "--interval", "0.1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert url in proc.stderr and "metrics_port" in proc.stderr
