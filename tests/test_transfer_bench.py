"""`kvtier bench transfer` runs end to end on a small size and reports every figure (values are
machine-dependent; only their presence and consistency are checked)."""

from __future__ import annotations

import ctypes.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench import transfer
from kvtier.errors import ConfigError

#: Every key ``kvtier bench transfer --json`` printed before its result became typed classes.
KEYS = set(
    [
        "pipeline_geometry",
        "pipeline_codec",
        "bytes_read_ratio",
        "ssd_encoded_blocks",
        "pipeline_bytes",
        "pipeline_blocks",
        "pipeline_chunk_blocks",
        "pipeline_buffer_chunks",
        "pipeline_ssd_fraction",
        "threads",
        "calibration_stage_rates_gib_per_s",
        "stage_workers",
        "stage_seconds",
        "whole_request_stage_seconds",
        "whole_request_sequential_s",
        "sequential_s",
        "pipelined_s",
        "slowest_stage",
        "pipeline_ratio_to_sequential",
        "pipeline_ratio_to_whole_request_sequential",
        "pipeline_ratio_to_slowest_stage",
        "chunk_stage_seconds",
        "chunk_sequential_s",
        "pipeline_ratio_to_chunk_sequential",
        "pipelined_gib_per_s",
        "per_chunk_allocation_s",
        "preallocated_speedup",
        "duplex_geometry",
        "duplex_device",
        "duplex_limit_copies",
        "swap_blocks",
        "swap_bytes",
        "segments_per_block",
        "segment_bytes",
        "memcpy_gib_per_s",
        "batched_swap_out_gib_per_s",
        "per_segment_swap_out_gib_per_s",
        "batched_ratio_to_memcpy",
        "batched_speedup_vs_per_segment",
        "duplex_s",
        "serial_s",
        "duplex_ratio_to_serial",
        "memcpy_two_serial_s",
        "memcpy_two_at_once_s",
        "duplex_limit_ratio",
        "duplex_ratio_to_limit",
    ]
)


def test_bench_reports_every_ratio() -> None:
    result = transfer.run(total_bytes=4 * 2**20, repeats=1, threads=4, swap_blocks=2, show=False)
    r = result.as_dict()  # as --json prints it
    assert set(r) == KEYS
    for key in (
        "pipeline_ratio_to_sequential",
        "pipeline_ratio_to_slowest_stage",
        "preallocated_speedup",
        "batched_speedup_vs_per_segment",
        "duplex_ratio_to_serial",
        "duplex_limit_ratio",
        "duplex_ratio_to_limit",
    ):
        assert math.isfinite(r[key]) and r[key] > 0, key
    assert r["pipeline_blocks"] == 2 and r["pipeline_ssd_fraction"] == 1.0
    # The SSD tier stores quant codec objects: the read stage moves about a quarter of the bytes.
    assert r["ssd_encoded_blocks"] >= 2 and 0 < r["bytes_read_ratio"] < 0.4, r["bytes_read_ratio"]
    assert set(r["stage_seconds"]) == set(transfer.STAGE_NAMES)
    assert math.isclose(r["whole_request_sequential_s"], sum(r["whole_request_stage_seconds"].values()))
    assert math.isclose(r["chunk_sequential_s"], sum(r["chunk_stage_seconds"].values()))
    assert r["sequential_s"] == min(r["whole_request_sequential_s"], r["chunk_sequential_s"])
    assert max(r["stage_seconds"].values()) <= r["sequential_s"]
    assert sum(r["stage_workers"].values()) == 4
    # One buffer region per stage worker at least: a chunk is only worked on while it owns one.
    assert r["pipeline_buffer_chunks"] >= sum(r["stage_workers"].values())
    assert r["duplex_device"] == "host" and r["duplex_limit_copies"] == "host memcpys"
    assert r["segments_per_block"] == 128
    assert math.isclose(r["duplex_limit_ratio"], r["memcpy_two_at_once_s"] / r["memcpy_two_serial_s"])
    assert math.isclose(r["duplex_ratio_to_limit"], r["duplex_ratio_to_serial"] / r["duplex_limit_ratio"])
    assert "pipelined" in transfer.summary(result)


def test_cli_json() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "bench",
            "transfer",
            "--total",
            "2MiB",
            "--repeats",
            "1",
            "--swap-blocks",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout)["pipeline_blocks"] == 1


def test_device_names_are_parsed_and_bad_ones_named() -> None:
    assert transfer.cuda_device("host") is None
    assert transfer.cuda_device("cuda") == 0 and transfer.cuda_device("cuda:3") == 3
    for bad in ("gpu", "cuda:x", "cuda:-1", "cuda:", "CUDA:0", ""):
        with pytest.raises(ConfigError, match="--device"):
            transfer.cuda_device(bad)


@pytest.mark.skipif(
    ctypes.util.find_library("cudart") is not None or Path("/usr/local/cuda").exists(),
    reason="a CUDA runtime is installed here",
)
def test_cli_with_a_gpu_device_and_no_cuda_runtime_fails_before_the_pipeline(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "transfer", "--device", "cuda:0", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "KVTIER_CUDART": str(tmp_path / "libcudart.so")},
        timeout=60,
    )
    assert out.returncode != 0 and "libcudart" in out.stderr and out.stdout == "", out.stderr
