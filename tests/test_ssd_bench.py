"""``kvtier bench ssd`` runs end to end on small sizes and reports every figure the issue names."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvtier import cli

FIGURES = [
    "read_ratio_to_raw_device",
    "write_ratio_to_raw_device",
    "speedup_vs_file_per_object_small",
    "speedup_vs_file_per_object_large",
    "striping_ratio_to_sum",
    "speedup_vs_round_robin",
    "recovery_s_per_million_objects",
]


#: Every key ``kvtier bench ssd --json`` printed before its result became typed classes (engine auto).
KEYS = [
    "bench",
    "directory",
    "io_depth",
    "load_average_1m_start",
    "large_objects",
    "large_bytes",
    "raw_read_gib_per_s",
    "raw_write_gib_per_s",
    "pool_read_gib_per_s",
    "pool_write_gib_per_s",
    "read_ratio_to_raw_device",
    "write_ratio_to_raw_device",
    "engine",
    "direct_io",
    "read_p50_s",
    "read_p99_s",
    "speedup_vs_file_per_object_small",
    "write_speedup_vs_file_per_object_small",
    "small_files_read_mib_per_s",
    "small_files_write_mib_per_s",
    "small_pool_read_mib_per_s",
    "small_pool_write_mib_per_s",
    "speedup_vs_file_per_object_large",
    "write_speedup_vs_file_per_object_large",
    "large_files_read_mib_per_s",
    "large_files_write_mib_per_s",
    "large_pool_read_mib_per_s",
    "large_pool_write_mib_per_s",
    "small_objects",
    "large_file_objects",
    "striping_throttle_bytes_per_s",
    "striping_alone_bytes_per_s",
    "striping_aggregate_bytes_per_s",
    "striping_ratio_to_sum",
    "speedup_vs_round_robin",
    "striping_bandwidth_source",
    "striping_probed_bytes_per_s",
    "striping_objects_per_device",
    "recovery_objects",
    "recovery_s",
    "recovery_s_per_million_objects",
    "open_s_per_million_objects",
    "load_average_1m_end",
]
DEPTH_KEYS = [
    "raw_read_depth_gib_per_s",
    "raw_write_depth_gib_per_s",
    "read_ratio_to_raw_device_same_depth",
    "write_ratio_to_raw_device_same_depth",
]


def test_bench_ssd_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "ssd", "--json", "--directory", str(tmp_path), "--total", "16MiB", "--small-count", "16"]
    args += ["--large-count", "4", "--stripe-count", "8", "--recovery-objects", "300", "--repeats", "1"]
    assert cli.main(args) == 0
    result = json.loads(capsys.readouterr().out)
    depth = DEPTH_KEYS if result["engine"] != "pread" else []
    assert set(result) == {*KEYS, *depth}
    for name in FIGURES:
        assert math.isfinite(result[name]) and result[name] > 0, name
    assert result["direct_io"] is True
    assert result["recovery_objects"] == 300
    assert sum(result["striping_objects_per_device"]) == 8
    assert list(tmp_path.iterdir()) == [], "the bench leaves no files behind"


def test_bench_ssd_summary_and_pread_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "ssd", "--directory", str(tmp_path), "--total", "8MiB", "--small-count", "8"]
    args += ["--large-count", "2", "--stripe-count", "4", "--recovery-objects", "100", "--repeats", "1"]
    assert cli.main([*args, "--io-engine", "pread"]) == 0
    out = capsys.readouterr().out
    assert "read_ratio_to_raw_device" in out and "(pread," in out
