from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier import cli

#: The keys ``kvtier demo --json`` printed before its result became a typed class.
DEMO_KEYS = (
    "demo geometry conversations turns prompt_tokens hit_tokens token_hit_rate loaded_bytes put_bytes "
    "load_gib_per_s put_gib_per_s store per_turn"
)
DEMO_STORE_KEYS = "objects used_bytes capacity_bytes evictions checksum_failures hit_blocks miss_blocks"


def test_demo_json_runs_and_hits(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        cli.main(["demo", "--json", "--conversations", "2", "--turns", "3", "--dram-capacity", "1GiB"]) == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert set(result) == set(DEMO_KEYS.split()) and result["demo"] == "multi-turn"
    assert set(result["store"]) == set(DEMO_STORE_KEYS.split())
    assert set(result["per_turn"][0]) == {"turn", "conversation", "prompt_tokens", "hit_tokens"}
    assert result["hit_tokens"] > 0
    assert 0 < result["token_hit_rate"] < 1
    assert result["store"]["checksum_failures"] == 0
    later_turns = [t for t in result["per_turn"] if t["turn"] > 0]
    assert all(t["hit_tokens"] > 0 for t in later_turns)


#: The keys ``kvtier bench layout|store --json`` print.
LAYOUT_KEYS = (
    "bench geometry tokens blocks bytes segments threads repeats memcpy_gib_per_s gather_gib_per_s "
    "scatter_gib_per_s gather_per_segment_gib_per_s scatter_per_segment_gib_per_s gather_ratio_to_memcpy "
    "scatter_ratio_to_memcpy speedup_vs_per_segment gather_speedup_vs_per_segment scatter_speedup_vs_per_segment"
)
STORE_KEYS = (
    "bench object_bytes objects bytes copy_threads repeats memcpy_gib_per_s put_gib_per_s get_gib_per_s "
    "put_ratio_to_memcpy get_ratio_to_memcpy put_vs_memcpy load_vs_memcpy pool_load_gib_per_s pool_load_ratio_to_get "
    "engine_pool_load_gib_per_s engine_pool_load_ratio_to_get load_then_scatter_gib_per_s pool_put_gib_per_s "
    "pool_put_ratio_to_put pool_load_random_gib_per_s pool_load_random_ratio_to_get "
    "engine_pool_load_random_gib_per_s engine_pool_load_random_ratio_to_get pool_put_random_gib_per_s "
    "pool_put_random_ratio_to_put lookup_tokens "
    "lookup_128k_tokens_ms lookup_hash_ms lookup_index_ms lookup_hash_from_list_ms evictions checksum_failures"
)


def test_bench_layout_json_small(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "layout", "--json", "--tokens", "256", "--repeats", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == set(LAYOUT_KEYS.split()) and result["bench"] == "layout"
    assert result["geometry"]["num_layers"] == 32
    for key in ("gather_ratio_to_memcpy", "scatter_ratio_to_memcpy", "speedup_vs_per_segment"):
        assert result[key] > 0


def test_bench_store_json_small(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "store", "--json", "--total", "16MiB", "--repeats", "1", "--lookup-tokens", "4096"]
    assert cli.main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == set(STORE_KEYS.split()) and result["bench"] == "store"
    for key in (
        "put_ratio_to_memcpy",
        "get_ratio_to_memcpy",
        "pool_load_ratio_to_get",
        "engine_pool_load_ratio_to_get",
        "pool_put_ratio_to_put",
        "pool_load_random_ratio_to_get",
        "engine_pool_load_random_ratio_to_get",
        "pool_put_random_ratio_to_put",
        "lookup_128k_tokens_ms",
    ):
        assert result[key] > 0
    assert result["load_vs_memcpy"] == result["get_ratio_to_memcpy"]  # issue 19's names
    assert result["put_vs_memcpy"] == result["put_ratio_to_memcpy"]


def test_bad_size_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--dram-capacity", "lots"]) == 2
    assert "dram-capacity" in capsys.readouterr().err


def test_unknown_command_exits_nonzero() -> None:
    with pytest.raises(SystemExit):
        cli.main(["frobnicate"])


def test_sim_run_and_sweep_write_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "sim.yaml"
    config.write_text(
        "name: tiny\n"
        "hardware: h100-sxm\n"
        "model: llama-3.1-8b\n"
        "policy: {name: hicache}\n"
        "block_tokens: 16\n"
        "host_capacity_bytes: 10GiB\n"
        "workload: {name: multiturn, num_sessions: 10, rate_per_s: 1.0}\n"
        "slo: {ttft_s: 1.0, tpot_s: 0.05}\n"
    )
    out = tmp_path / "result.json"
    assert cli.main(["sim", "run", str(config), "--json", "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["requests"] > 10 and result["unfinished_requests"] == 0
    assert json.loads(out.read_text())["requests"] == result["requests"]
    sweep_dir = tmp_path / "sweep"
    args = [
        "sim",
        "sweep",
        str(config),
        "--rates",
        "0.5,2",
        "--policies",
        "fcfs,hicache",
        "--out-dir",
        str(sweep_dir),
    ]
    assert cli.main([*args, "--json"]) == 0
    sweep = json.loads(capsys.readouterr().out)
    assert set(sweep["series"]) == {"fcfs", "hicache"}
    for png in sweep["plots"]:
        data = Path(png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_sim_bad_config_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("policy: {name: nonsense}\n")
    assert cli.main(["sim", "run", str(config)]) == 2
    assert "unknown policy 'nonsense'" in capsys.readouterr().err
    assert cli.main(["sim", "run", str(tmp_path / "nope.yaml")]) == 2
    assert cli.main(["sim", "sweep", str(config), "--rates", "0,-1"]) == 2


def test_a_deprecated_policy_name_is_announced_on_the_command_line(tmp_path: Path) -> None:
    # Python hides DeprecationWarnings outside __main__ by default: the command must show them.
    config = tmp_path / "old.yaml"
    config.write_text(
        "name: tiny\n"
        "hardware: h100-sxm\n"
        "model: llama-3.1-8b\n"
        "policy: {name: unified_pool_passthrough}\n"
        "block_tokens: 16\n"
        "host_capacity_bytes: 10GiB\n"
        "workload: {name: multiturn, num_sessions: 3, rate_per_s: 1.0}\n"
        "slo: {ttft_s: 1.0, tpot_s: 0.05}\n"
    )
    env = {**os.environ, "PYTHONWARNINGS": ""}
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "sim", "run", str(config), "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "DeprecationWarning" in done.stderr and "lmcache_lp_async" in done.stderr


def test_bench_engine_refuses_an_unknown_calibration_before_timing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.yaml"
    assert cli.main(["bench", "engine", "--json", "--calibration", str(missing)]) == 2
    assert f"calibration {str(missing)!r} is neither a file nor one of" in capsys.readouterr().err
