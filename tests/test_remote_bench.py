"""``kvtier bench remote`` runs end to end on its own loopback server (small objects; the figures
themselves are measured by the benchmark, not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtier.bench import remote
from kvtier.errors import KvtierError

BENCH_KEYS = (
    "object_bytes objects batch repeats server single cluster get_ratio_to_raw_redis set_ratio_to_raw_redis "
    "lookup_512_keys_ms"
)
FIGURE_KEYS = (
    "get_ratio_to_raw_redis_median_of_rounds set_ratio_to_raw_redis_median_of_rounds get_ratio_to_raw_redis "
    "set_ratio_to_raw_redis kvtier_get_gib_per_s kvtier_set_gib_per_s raw_get_gib_per_s raw_set_gib_per_s "
    "lookup_512_keys_ms get_p50_s get_p99_s errors"
)


def test_bench_reports_every_figure_single_and_cluster() -> None:
    result = remote.run(object_bytes=64 * 1024, objects=8, batch=4, repeats=1)
    r = result.as_dict()  # as --json prints it: the keys it has always had
    assert set(r) == set(BENCH_KEYS.split())
    assert set(r["single"]) == set(FIGURE_KEYS.split()) and set(r["cluster"]) == {
        *FIGURE_KEYS.split(),
        "masters",
    }
    for where in (r["single"], r["cluster"]):
        for k in ("get_ratio_to_raw_redis", "set_ratio_to_raw_redis", "lookup_512_keys_ms"):
            assert where[k] > 0, k
        assert where["errors"] == 0
    assert r["cluster"]["masters"] == 3
    assert r["get_ratio_to_raw_redis"] == r["single"]["get_ratio_to_raw_redis"]
    assert "get" in remote.summary(result)


def test_cli_prints_json() -> None:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "kvtier.cli", "bench", "remote", "--no-cluster"),
            *("--object-bytes", "64KiB", "--objects", "4", "--batch", "2", "--repeats", "1", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    r = json.loads(done.stdout)
    assert "cluster" not in r and set(r) == set(BENCH_KEYS.split()) - {"cluster"}
    assert r["object_bytes"] == 64 * 1024 and r["set_ratio_to_raw_redis"] > 0


def test_bad_arguments_are_errors() -> None:
    with pytest.raises(KvtierError, match="positive"):
        remote.run(objects=0)
