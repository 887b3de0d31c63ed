"""The composed policy's evaluation (``kvtier sim reproduce composed``) in quick mode: every
single-paper policy and the composed one run on both workloads, the rows carry no paper ratio, and
the report prints them as such."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.sim import reproduce
from kvtier.sim.reproduce.composed import COMPOSED, PIECES, SINGLE
from kvtier.sim.xfer import xfer_blocks


def test_quick_reproduction_compares_composed_with_each_paper_alone(tmp_path: Path) -> None:
    rows = reproduce.run("composed", tmp_path, quick=True)
    assert "composed" in reproduce.papers()
    assert (tmp_path / "composed.png").stat().st_size > 0
    assert all(r.paper == "composed" and r.paper_ratio is None and r.paper_range is None for r in rows)
    assert all(r.within_30_percent is None and r.kvtier_ratio >= 0 for r in rows)
    for workload in ("mooncake", "agentic"):
        metrics = [r.metric for r in rows if r.metric.startswith(workload)]
        for what in ("TTFT SLO attainment", "TBT SLO attainment", "output throughput"):
            for name in COMPOSED:
                assert any(f"{what}, {name} / best single paper" in m for m in metrics), (workload, what)
        for piece in PIECES:
            assert any(m.endswith(f"composed / composed without {piece}") for m in metrics)
        # The note lists every policy of the comparison with its numbers.
        note = next(r.note for r in rows if r.metric.startswith(workload) and r.note.startswith("fcfs"))
        for name in (*SINGLE, *COMPOSED):
            assert f"{name}: TTFT " in note


def test_transfer_budget_is_derived_from_the_profiles() -> None:
    from kvtier.sim.config import SimConfig
    from kvtier.sim.reproduce import experiments_dir

    mooncake = SimConfig.from_yaml(experiments_dir() / "composed" / "mooncake.yaml")
    agentic = SimConfig.from_yaml(experiments_dir() / "composed" / "agentic.yaml")
    # 2400 x 16 Qwen2.5-32B tokens (256 KiB each) over C2C at its both-ways H2D rate (270 GB/s x
    # 384/508.64 = 204 GB/s): ~49 ms; over 50 GB/s PCIe that is 2.5 GB, i.e. 36 Llama-3.1-8B blocks of
    # 512 tokens (64 MiB) or 294 of 64 tokens (8 MiB).
    assert xfer_blocks(mooncake) == (36, 75)
    assert xfer_blocks(agentic) == (294, 600)
    assert mooncake.policy["xfer_blocks"] == 36 and agentic.policy["xfer_blocks"] == 294


def test_report_prints_rows_without_a_paper_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    row = reproduce.Row("composed", "m", None, 1.5)
    assert row.to_dict()["within_30_percent"] is None
    reproduce._REGISTRY["_composed_print_test"] = lambda out_dir, quick: [row]
    try:
        assert main(["sim", "reproduce", "_composed_print_test", "--out-dir", str(tmp_path)]) == 0
    finally:
        del reproduce._REGISTRY["_composed_print_test"]
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("composed"))
    assert line.split()[-3:] == ["-", "1.50", "n/a"]
