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


def test_bench_ssd_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "ssd", "--json", "--directory", str(tmp_path), "--total", "16MiB", "--small-count", "16"]
    args += ["--large-count", "4", "--stripe-count", "8", "--recovery-objects", "300", "--repeats", "1"]
    assert cli.main(args) == 0
    result = json.loads(capsys.readouterr().out)
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
