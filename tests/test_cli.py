from __future__ import annotations

import json

import pytest

from kvtier import cli


def test_demo_json_runs_and_hits(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        cli.main(["demo", "--json", "--conversations", "2", "--turns", "3", "--dram-capacity", "1GiB"]) == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["hit_tokens"] > 0
    assert 0 < result["token_hit_rate"] < 1
    assert result["store"]["checksum_failures"] == 0
    later_turns = [t for t in result["per_turn"] if t["turn"] > 0]
    assert all(t["hit_tokens"] > 0 for t in later_turns)


def test_bench_layout_json_small(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "layout", "--json", "--tokens", "256", "--repeats", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("gather_ratio_to_memcpy", "scatter_ratio_to_memcpy", "speedup_vs_per_segment"):
        assert result[key] > 0


def test_bench_store_json_small(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "store", "--json", "--total", "16MiB", "--repeats", "1", "--lookup-tokens", "4096"]
    assert cli.main(args) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("put_ratio_to_memcpy", "get_ratio_to_memcpy", "lookup_128k_tokens_ms"):
        assert result[key] > 0


def test_bad_size_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--dram-capacity", "lots"]) == 2
    assert "dram-capacity" in capsys.readouterr().err


def test_unknown_command_exits_nonzero() -> None:
    with pytest.raises(SystemExit):
        cli.main(["frobnicate"])
