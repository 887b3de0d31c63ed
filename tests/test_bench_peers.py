"""``kvtier bench peers`` without its peers: argument parsing, the per-round ratios and their
median/range, and the summary table, from per-round timings given as data (the real run is a
benchmark: ``kvtier bench peers``)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.bench import peers, peers_ssd, peers_table
from kvtier.bench.kv_fixture import CHECKOUT_PATH
from kvtier.cli import build_parser
from kvtier.errors import KvtierError


def test_defaults_and_flags_parse() -> None:
    args = build_parser().parse_args(["bench", "peers"])
    assert (args.rounds, args.bytes, args.venv, args.json, args.threads) == (
        5,
        "1GiB",
        ".venv-peers",
        False,
        0,
    )
    args = build_parser().parse_args(
        ["bench", "peers", "--json", "--rounds", "7", "--bytes", "256MiB", "--venv", "v"]
    )
    assert (args.rounds, args.bytes, args.venv, args.json) == (7, "256MiB", "v", True)
    assert (args.parts, args.ssd_bytes, args.ssd_dir) == (("dram", "lookup", "remote", "ssd"), "512MiB", None)
    args = build_parser().parse_args(
        ["bench", "peers", "--parts", "ssd, dram,ssd", "--ssd-bytes", "64MiB", "--ssd-dir", "/d"]
    )
    assert (args.parts, args.ssd_bytes, args.ssd_dir) == (("ssd", "dram"), "64MiB", "/d")


@pytest.mark.parametrize("parts", ["disk", "ssd,nvme", "", ","])
def test_an_unknown_part_is_a_usage_error(parts: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "peers", "--parts", parts])
    assert e.value.code == 2
    assert "dram, lookup, remote, ssd" in capsys.readouterr().err


@pytest.mark.parametrize("rounds", ["4", "0", "-1", "five"])
def test_fewer_than_five_rounds_is_a_usage_error(rounds: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "peers", "--rounds", rounds])
    assert e.value.code == 2
    assert "--rounds" in capsys.readouterr().err


def test_too_few_bytes_is_an_error_before_any_install(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import main

    assert main(["bench", "peers", "--bytes", "1MiB", "--venv", "/nonexistent/venv"]) == 2
    assert "--bytes is 1MiB" in capsys.readouterr().err
    assert main(["bench", "peers", "--ssd-bytes", "16MiB", "--venv", "/nonexistent/venv"]) == 2
    assert "--ssd-bytes is 16MiB" in capsys.readouterr().err
    assert main(["bench", "peers", "--ssd-dir", "/nonexistent/dir", "--venv", "/nonexistent/venv"]) == 2
    assert "--ssd-dir '/nonexistent/dir'" in capsys.readouterr().err


def _dram(memcpy_s: float, scale: float) -> dict[str, Any]:
    ops = {"store": 0.1, "retrieve": 0.2, "pool_store": 0.4, "pool_retrieve": 0.5}
    return {"memcpy_s": memcpy_s, "ops": {k: v * scale for k, v in ops.items()}}


def _round(kvtier_scale: float, lmcache_scale: float, load: float) -> dict[str, Any]:
    return {
        "dram": {
            "kvtier": _dram(0.1, kvtier_scale),
            "lmcache": _dram(0.08, lmcache_scale),
            "load_avg_1m": load,
        },
        "lookup": {
            "kvtier": {"ops": {"list": 0.002, "array": 0.001}},
            "lmcache": {"ops": {"list": 0.004, "array": 0.005}},
            "load_avg_1m": load,
        },
    }


def _rows(per_round: list[dict[str, Any]], unavailable: dict[str, str]) -> dict[str, dict[str, Any]]:
    return {row.key: row.as_dict() for row in peers_table.aggregate(per_round, unavailable)}


def test_ratios_are_per_round_then_median_and_range() -> None:
    # kvtier's times scale by 1, 2, 1, 1, 4 over the rounds; LMCache's stay at 2x the base.
    per_round = [
        _round(s, 2.0, load) for s, load in zip([1, 2, 1, 1, 4], [1.0, 1.5, 0.9, 2.5, 1.1], strict=True)
    ]
    rows = _rows(per_round, {"mooncake": "libibverbs1 is missing"})
    store = rows["dram_store"]
    assert store["speed_ratio"]["rounds"] == pytest.approx([2.0, 1.0, 2.0, 2.0, 0.5])
    assert (store["speed_ratio"]["median"], store["speed_ratio"]["min"], store["speed_ratio"]["max"]) == (
        pytest.approx(2.0),
        pytest.approx(0.5),
        pytest.approx(2.0),
    )
    # Each side against the memcpy timed in its own process: kvtier 0.1 / (0.1 * s), LMCache 0.08 / 0.2.
    assert store["kvtier_vs_memcpy"]["rounds"] == pytest.approx([1.0, 0.5, 1.0, 1.0, 0.25])
    assert store["peer_vs_memcpy"]["median"] == pytest.approx(0.4)
    assert rows["pool_retrieve"]["kvtier_vs_memcpy"]["median"] == pytest.approx(0.2)
    assert rows["dram_store"]["load_avg_1m"]["median"] == pytest.approx(1.1)
    assert rows["dram_store"]["load_avg_1m"]["max"] == pytest.approx(2.5)
    # Lookups have no memcpy; the ratio is still the peer's time over kvtier's.
    assert "kvtier_vs_memcpy" not in rows["lookup_list"]
    assert rows["lookup_list"]["speed_ratio"]["median"] == pytest.approx(2.0)
    assert rows["lookup_array"]["speed_ratio"]["median"] == pytest.approx(5.0)
    # A peer that cannot run gives the reason, never a number.
    for key in ("remote_put", "remote_get"):
        assert rows[key]["not_run"] == "libibverbs1 is missing"
        assert "speed_ratio" not in rows[key]


def test_a_failed_worker_in_any_round_voids_its_rows_with_the_error() -> None:
    per_round = [_round(1, 2, 1.0) for _ in range(5)]
    per_round[3]["dram"]["lmcache"] = {"error": "lmcache dram worker exit 1: retrieve returned wrong bytes"}
    rows = _rows(per_round, {})
    for key in ("dram_store", "dram_retrieve", "pool_store", "pool_retrieve"):
        assert "wrong bytes" in rows[key]["not_run"]
        assert "speed_ratio" not in rows[key]
    assert rows["lookup_list"]["speed_ratio"]["median"] == pytest.approx(2.0)
    assert rows["remote_put"]["not_run"] == "no rounds ran"  # no remote part in these rounds


def test_every_row_names_a_part_the_bench_runs() -> None:
    assert {row.part for row in peers_table.ROWS} == set(peers_table.PARTS)
    assert all(peers_table.PARTS[row.part] == row.peer for row in peers_table.ROWS)
    assert len({row.key for row in peers_table.ROWS}) == len(peers_table.ROWS)


def test_summary_renders_the_table_and_the_reasons() -> None:
    per_round = [_round(1, 2, 1.0) for _ in range(5)]
    unavailable = {"mooncake": "mooncake holder did not start: setup returned -1\nmore detail"}
    result = peers_table.PeersResult(
        bytes=2**30,
        rounds=5,
        parts=list(peers_table.PARTS),
        copy_threads=0,
        versions={"lmcache": "0.5.6", "torch": "2.13.0", "mooncake-transfer-engine-non-cuda": None},
        unavailable=unavailable,
        not_measured={"ssd": "not in this bench yet"},
        rows=peers_table.aggregate(per_round, unavailable),
        per_round=per_round,
    )
    json.dumps(result.as_dict())  # the --json output is plain JSON
    text = peers_table.summary(result)
    lines = text.splitlines()
    assert "1.00 GiB" in lines[0] and "lmcache 0.5.6" in lines[0] and "torch 2.13.0" in lines[0]
    assert "| work | kvtier ÷ memcpy | peer ÷ memcpy | kvtier speed ÷ peer | peer | load avg 1m |" in lines
    assert (
        "| DRAM store (hash + put) | 1.00 (1.00-1.00) | 0.40 (0.40-0.40) | **2.00 (2.00-2.00)** | lmcache |"
        in text
    )
    assert "| hash + lookup of 128K tokens, int64 array | - | - | **5.00 (5.00-5.00)** | lmcache |" in text
    remote = [ln for ln in lines if ln.startswith("| remote put")]
    assert remote and "not run: mooncake holder did not start: setup returned -1 |" in remote[0]
    assert "ssd: not in this bench yet" in lines
    assert "more detail" not in text  # one line per reason in the table; the JSON keeps it all
    assert not any(ln.startswith("remote rows:") for ln in lines)  # no server recorded, none shown
    result = dataclasses.replace(
        result,
        redis_server={
            "binary": "/usr/bin/redis-server",
            "version": "Redis server v=7.0.15 sha=00000000:0 malloc=jemalloc-5.3.0 bits=64",
            "malloc_conf": "muzzy_decay_ms:-1",
        },
    )
    lines = peers_table.summary(result).splitlines()
    assert "remote rows: Redis server v=7.0.15, MALLOC_CONF=muzzy_decay_ms:-1" in lines


def _ssd_round(kvtier_s: tuple[float, float, float], lmcache_s: tuple[float, float, float]) -> dict[str, Any]:
    """Seconds of put, durable put and cold get per side; the O_DIRECT-put row takes each side's
    put time (LMCache's worker reports its one put under both)."""
    ops = ("ssd_put", "ssd_durable_put", "ssd_cold_get")

    def side(memcpy_s: float, seconds: tuple[float, float, float]) -> dict[str, Any]:
        timed = dict(zip(ops, seconds, strict=True))
        return {"memcpy_s": memcpy_s, "ops": {**timed, "ssd_direct_put": timed["ssd_put"]}}

    return {"ssd": {"kvtier": side(0.05, kvtier_s), "lmcache": side(0.04, lmcache_s), "load_avg_1m": 3.0}}


def test_ssd_rows_are_ratios_of_their_own_part_and_only_selected_parts_are_rows() -> None:
    per_round = [_ssd_round((0.5, 1.0, 0.25), (0.5 * k, 2.0, 0.4)) for k in (1, 2, 1.1, 0.5, 1)]
    rows = _rows_of(peers_table.aggregate(per_round, {}, ("ssd",)))
    assert set(rows) == {"ssd_put", "ssd_direct_put", "ssd_durable_put", "ssd_cold_get"}
    assert rows["ssd_put"]["speed_ratio"]["rounds"] == pytest.approx([1, 2, 1.1, 0.5, 1])
    assert rows["ssd_put"]["speed_ratio"]["median"] == pytest.approx(1.0)
    assert rows["ssd_durable_put"]["speed_ratio"]["median"] == pytest.approx(2.0)
    assert rows["ssd_cold_get"]["speed_ratio"]["median"] == pytest.approx(1.6)
    assert rows["ssd_cold_get"]["kvtier_vs_memcpy"]["median"] == pytest.approx(0.2)  # 0.05 / 0.25
    assert rows["ssd_cold_get"]["peer_vs_memcpy"]["median"] == pytest.approx(0.1)  # 0.04 / 0.4
    # With every part selected, the parts that did not run say so instead of giving figures.
    everything = _rows_of(peers_table.aggregate(per_round, {}))
    assert everything["dram_store"]["not_run"] == "no rounds ran"
    assert everything["ssd_put"]["speed_ratio"]["median"] == pytest.approx(1.0)


def test_summary_of_the_ssd_part_names_its_size_and_file_system() -> None:
    per_round = [_ssd_round((0.5, 1.0, 0.25), (1.0, 2.0, 0.4)) for _ in range(5)]
    result = peers_table.PeersResult(
        bytes=2**30,
        rounds=5,
        copy_threads=0,
        parts=["ssd"],
        ssd_bytes=2**29,
        ssd_filesystem="ext4 (/dev/vda)",
        versions={"lmcache": "0.5.6"},
        unavailable={},
        not_measured=peers_table.NOT_MEASURED,
        rows=peers_table.aggregate(per_round, {}, ("ssd",)),
    )
    text = peers_table.summary(result)
    assert "ssd rows: 512 MiB of KV-like bf16 values per round on ext4 (/dev/vda)" in text
    assert "put into the page cache (direct_io=False)" in text
    assert "| **1.60 (1.60-1.60)** | lmcache | 3.00 (3.00-3.00) |" in text
    assert "DRAM store" not in text
    assert "use_odirect" in text  # what the rows leave out is printed with them


def _rows_of(rows: list[peers_table.PeerRow]) -> dict[str, dict[str, Any]]:
    return {row.key: row.as_dict() for row in rows}


def test_aligned_like_is_page_aligned_zeroed_and_shaped() -> None:
    objs = np.ones((3, 5000), dtype=np.uint8)
    out = peers_ssd.aligned_like(objs)
    assert out.shape == objs.shape and out.dtype == objs.dtype
    assert out.ctypes.data % peers_ssd.PAGE_BYTES == 0
    assert not out.any()


def test_dropping_a_file_from_the_page_cache_is_seen_by_mincore(tmp_path: Path) -> None:
    if peers_ssd.filesystem_of(tmp_path).split()[0] in ("tmpfs", "ramfs", "overlay"):
        pytest.skip("the page cache is the storage here")
    path = tmp_path / "chunk.bin"
    path.write_bytes(os.urandom(1 << 20))
    assert path.read_bytes()  # read back: cached
    assert peers_ssd.resident_bytes([path]) > 0
    assert peers_ssd.drop_from_page_cache([path]) == 0
    peers_ssd.fsync_paths([path], tmp_path)
    empty = tmp_path / "empty"
    empty.touch()
    assert peers_ssd.resident_bytes([empty]) == 0
    assert peers_ssd.device_read_bytes() >= 0


def test_filesystem_of_names_the_root_mount() -> None:
    assert peers_ssd.filesystem_of(Path("/")) != "unknown"
    assert peers_ssd.filesystem_of(Path("/proc/self")).startswith("proc ")


def test_kvtier_ssd_side_stores_and_reads_back_cold_in_a_fresh_process(tmp_path: Path) -> None:
    """kvtier's side of the ssd part, as the bench runs it (32 MiB): its checks (every block
    written through, buffered for ``ssd_put`` and O_DIRECT for the others, the cold get's bytes
    equal and read from the device) pass."""
    if peers_ssd.filesystem_of(tmp_path).split()[0] in ("tmpfs", "ramfs", "overlay"):
        pytest.skip("no O_DIRECT here")
    spec = {"seed": 3, "ssd_bytes": 32 * 2**20, "ssd_root": str(tmp_path), "copy_threads": 1}
    spec["kv_fixture"] = str(CHECKOUT_PATH)
    worker = str(Path(peers.WORKER))
    proc = subprocess.run(
        [sys.executable, "-P", worker, "kvtier", "ssd", json.dumps(spec)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1][len("RESULT ") :])
    assert set(result["ops"]) == {"ssd_put", "ssd_direct_put", "ssd_durable_put", "ssd_cold_get"}
    assert all(seconds > 0 for seconds in result["ops"].values())
    assert result["bytes"] == 32 * 2**20
    assert "O_DIRECT" in result["config"]
    assert list(tmp_path.iterdir()) == []  # its directories are gone


#: The keys ``kvtier bench peers --json`` prints (docs/benchmarks.md).
PEERS_KEYS = {
    "bench", "bytes", "rounds", "parts", "copy_threads", "ssd_bytes", "ssd_filesystem", "ssd_codec", "versions",
    "redis_server", "python", "unavailable", "not_measured", "rows", "per_round",
}  # fmt: skip
ROW_KEYS = {
    "key",
    "label",
    "peer",
    "kvtier_s",
    "peer_s",
    "speed_ratio",
    "kvtier_vs_memcpy",
    "peer_vs_memcpy",
    "load_avg_1m",
}


def test_the_json_keys_are_unchanged() -> None:
    per_round = [_round(1, 2, 1.0) for _ in range(5)]
    result = peers_table.PeersResult(
        bytes=2**30, rounds=5, parts=["dram", "lookup"], copy_threads=0, versions={}, unavailable={},
        not_measured={}, rows=peers_table.aggregate(per_round, {}, ("dram", "lookup")), per_round=per_round,
    )  # fmt: skip
    out = json.loads(json.dumps(result.as_dict()))
    assert set(out) == PEERS_KEYS and out["bench"] == "peers"
    rows = {row["key"]: row for row in out["rows"]}
    assert set(rows["dram_store"]) == ROW_KEYS
    assert set(rows["lookup_list"]) == ROW_KEYS - {"kvtier_vs_memcpy", "peer_vs_memcpy"}
    assert set(rows["dram_store"]["speed_ratio"]) == {"median", "min", "max", "rounds"}
    assert out["per_round"] == per_round
    not_run = peers_table.aggregate([], {"lmcache": "why"}, ("dram",))[0].as_dict()
    assert not_run == {"key": "dram_store", "label": not_run["label"], "peer": "lmcache", "not_run": "why"}


@pytest.mark.parametrize(
    ("result", "field"),
    [
        ([], "is not a JSON object"),
        ({"ops": [1.0]}, "`ops` is [1.0]; expected dict"),
        ({"ops": {"store": "fast"}}, "ops: `store` is 'fast'; expected float"),
        ({"ops": {"store": 1.0}, "memcpy_s": None}, "`memcpy_s` is None; expected float"),
        ({"ops": {}, "bytes": 1.5}, "`bytes` is 1.5; expected int"),
        ({"ops": {}, "bytes": True}, "`bytes` is True; expected int"),
    ],
)
def test_an_ill_typed_worker_result_is_an_error_naming_the_field(result: object, field: str) -> None:
    from kvtier.errors import KvtierError

    with pytest.raises(KvtierError, match="kvtier dram worker's RESULT") as e:
        peers.parse_result(result, "kvtier dram worker's RESULT")
    assert field in str(e.value)


def test_a_worker_result_parses_into_its_typed_fields() -> None:
    got = peers.parse_result(
        {"ops": {"store": 1, "get": 0.5}, "memcpy_s": 0.25, "bytes": 4, "config": "c"}, "w"
    )
    assert got == {"ops": {"store": 1.0, "get": 0.5}, "memcpy_s": 0.25, "bytes": 4, "config": "c"}
    assert isinstance(got["ops"]["store"], float)


def test_kv_objects_are_kv_like_reproducible_and_never_repeat() -> None:
    """The SSD rows' bytes: bf16 values drawn per channel from real KV, the same for a seed in
    every process, compressible about as real bf16 KV is (random bytes are not), no two
    objects equal."""
    from kvtier import codec

    objs = peers_ssd.kv_objects(3, 7, CHECKOUT_PATH)
    assert objs.shape == (3, 2 * 2**20) and objs.dtype == np.uint8
    assert np.array_equal(objs, peers_ssd.kv_objects(3, 7, CHECKOUT_PATH))
    assert not np.array_equal(objs[0], objs[1]) and not np.array_equal(
        objs, peers_ssd.kv_objects(3, 8, CHECKOUT_PATH)
    )
    values = objs.view(np.uint16).astype(np.uint32) << 16
    floats = values.view(np.float32)
    assert np.isfinite(floats).all() and 0.05 < float(np.abs(floats).mean()) < 5
    ratio = objs[0].nbytes / len(codec.encode(objs[0], "lossless", backend="zstd"))
    assert 1.2 < ratio < 1.6  # real bf16 KV from the fixture: 1.38
    random = np.random.default_rng(0).integers(0, 256, objs[0].size, dtype=np.uint8)
    assert random.nbytes / len(codec.encode(random, "lossless", backend="zstd")) < 1.01


def test_bf16_bits_round_to_nearest_even() -> None:
    x = np.array([1.0, -2.5, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 0.0], dtype=np.float32)
    assert peers_ssd.bf16_bits(x).tolist() == [0x3F80, 0xC020, 0x3F80, 0x3F82, 0]


def test_a_stamp_of_the_same_pins_is_read_back_and_of_other_pins_is_redone(tmp_path: Path) -> None:
    spec: dict[str, object] = {"torch": ["torch==2"], "mooncake": "m==1"}
    path = tmp_path / peers.STAMP
    stamp = {"spec": spec, "versions": {"torch": "2.0", "lmcache": None}, "mooncake_unavailable": "no wheel"}
    path.write_text(json.dumps(stamp))
    assert peers._read_stamp(path, spec) == stamp
    assert peers._read_stamp(path, {**spec, "mooncake": "m==2"}) is None
    path.write_text(json.dumps({**stamp, "versions": {"torch": 2}}))
    with pytest.raises(KvtierError, match=r"`versions.torch` is 2; expected a string or null"):
        peers._read_stamp(path, spec)
    path.write_text(json.dumps({**stamp, "mooncake_unavailable": False}))
    with pytest.raises(KvtierError, match=r"`mooncake_unavailable` is False"):
        peers._read_stamp(path, spec)
