"""Regressions of the hardening issue (black-box test of 80fa599): passwords in URLs (5), size and
int fields that escaped ConfigError (8), YAML files that are not text or not a mapping (9), and
CLI user errors that printed tracebacks (11)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvtier
from kvtier import cli
from kvtier.config import StoreConfig, parse_size
from kvtier.errors import ConfigError, GeometryError
from kvtier.remote import redact_url

SECRET = "SECRETPW"
GEOMETRY = kvtier.Geometry(2, 2, 8, "fp16", 4)


# --- 5: credentials in URLs are never shown -------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        (f"redis://:{SECRET}@127.0.0.1:6379", "redis://:***@127.0.0.1:6379"),
        (f"redis://alice:{SECRET}@host:6380/2", "redis://alice:***@host:6380/2"),
        (f"rediss://alice:{SECRET}@[::1]:6380", "rediss://alice:***@[::1]:6380"),
        (f"redis://:{SECRET}/x@host", "redis://:***@host"),  # a '/' in the password
        (f"redis://:p@{SECRET}@host", "redis://:***@host"),  # an '@' in the password
        (f"http://:{SECRET}@host", "http://:***@host"),
        (f"redis://host/0?password={SECRET}", "redis://host/0?***"),
        ("redis://alice@host", "redis://alice@host"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ],
)
def test_defect5_redact_url_replaces_the_password(url: str, redacted: str) -> None:
    assert redact_url(url) == redacted


def test_defect5_store_config_repr_and_str_redact_passwords_and_to_dict_keeps_them() -> None:
    urls = (f"redis://:{SECRET}@127.0.0.1:7000", f"redis://alice:{SECRET}@127.0.0.1:7001")
    config = kvtier.StoreConfig(geometry=GEOMETRY, remote=kvtier.RemoteConfig(urls=urls, cluster=True))
    for text in (repr(config), str(config)):
        assert SECRET not in text
        assert "'redis://:***@127.0.0.1:7000'" in text
        assert "'redis://alice:***@127.0.0.1:7001'" in text
        assert text.startswith("StoreConfig(geometry=Geometry(")
    assert config.remote is not None and config.remote.urls == urls  # the config itself keeps the real URLs
    assert config.to_dict()["remote"]["urls"] == list(urls)
    assert kvtier.StoreConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{SECRET}@127.0.0.1:notaport",  # was the Rust parse_url message; now checked in Python
        f"redis://:{SECRET}@127.0.0.1:0",
        f"redis://:{SECRET}@127.0.0.1:65536",
        f"redis://alice:{SECRET}@127.0.0.1:6379/notadb",
        f"redis://:{SECRET}@127.0.0.1/4294967296",
        f"http://:{SECRET}@127.0.0.1:6379",
        f"redis://:{SECRET}@",
        f"redis://:{SECRET}@[::1",
        f"redis://:{SECRET}/x@127.0.0.1",
        f"redis://alice:{SECRET}/x@127.0.0.1",  # was quoted as the port
        f"redis://alice:1/{SECRET}@127.0.0.1",  # was quoted as the database
    ],
)
def test_defect5_bad_url_errors_do_not_show_the_password(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        kvtier.Store(kvtier.StoreConfig(geometry=GEOMETRY, remote={"urls": url}))
    message = str(info.value)
    assert SECRET not in message
    assert "remote.urls" in message and ":***@" in message


@pytest.mark.parametrize(
    "url", [f"redis://127.0.0.1/0?password={SECRET}", f"redis://127.0.0.1?password={SECRET}"]
)
def test_a_url_query_is_refused_without_showing_it(url: str) -> None:
    # It was quoted as the database (or the host) in the error.
    with pytest.raises(ConfigError, match="query") as info:
        kvtier.Store(kvtier.StoreConfig(geometry=GEOMETRY, remote={"urls": url}))
    assert SECRET not in str(info.value) and "?***" in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1",
        "redis://127.0.0.1:+6379/+0",
        "redis://alice:p%40ss@127.0.0.1:1/4294967295",
        "redis://:p@ss@127.0.0.1:65535",
        "rediss://[::1]:6380/0",
        "redis://127.0.0.1/",
    ],
)
def test_defect5_url_check_accepts_what_the_rust_parser_accepts(url: str) -> None:
    remote = kvtier.StoreConfig(geometry=GEOMETRY, remote={"urls": url}).remote
    assert remote is not None and remote.urls == (url,)


@pytest.mark.parametrize("flag", ["--url", "--cluster-url"])
def test_defect5_bench_remote_bad_url_does_not_print_the_password(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "remote", flag, f"redis://:{SECRET}@127.0.0.1:notaport"]) == 2
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err
    assert out.err.startswith(f"kvtier: error: `{flag}`: ")
    assert "redis://:***@127.0.0.1:notaport" in out.err and "port" in out.err


def test_defect5_bench_remote_run_checks_urls_before_connecting() -> None:
    from kvtier.bench import remote

    with pytest.raises(ConfigError) as info:
        remote.run(url=f"redis://:{SECRET}@127.0.0.1/x", cluster=False, objects=1, object_bytes=1)
    assert SECRET not in str(info.value)


# --- 8: sizes and ints are exact and range-checked ------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("9007199254740993", 9007199254740993),  # 2**53 + 1: a float rounds it to ...992
        ("18446744073709551615", 2**64 - 1),
        ("1.001KB", 1001),  # float: 1000
        ("1.001GB", 1_001_000_000),  # float: 1000999999
        ("1.5GiB", 3 * 2**29),
        ("0.1KiB", 102),  # rounded down to whole bytes
        ("0007 MiB", 7 * 2**20),
        pytest.param("2." + "0" * 60 + "1GiB", 2 * 2**30, id="60-fraction-digits"),
    ],
)
def test_defect8_sizes_parse_exactly(text: str, size: int) -> None:
    assert parse_size(text, "x") == size


@pytest.mark.parametrize(
    ("key", "value"),
    [
        pytest.param("dram.capacity_bytes", "1" + "0" * 400, id="dram-str-1e400"),
        # past Python's int <-> str digit limit (4300)
        pytest.param("dram.capacity_bytes", "1" + "0" * 5000, id="dram-str-1e5000"),
        pytest.param("dram.capacity_bytes", "1." + "0" * 5000 + "1GiB", id="dram-str-5000-fraction-digits"),
        pytest.param("dram.capacity_bytes", 10**5000, id="dram-int-1e5000"),
        ("dram.capacity_bytes", 2**63),
        ("dram.capacity_bytes", -1),
        ("remote.inflight_bytes_max", 10**30),
        ("remote.inflight_bytes_max", 2**64),
        ("remote.inflight_bytes_max", "20000000TiB"),
        ("ssd.capacity_bytes", 2**64),
        pytest.param("ssd.capacity_bytes", "1" + "0" * 400, id="ssd-str-1e400"),
        ("ssd.probe_bytes", 10**30),
    ],
)
def test_defect8_out_of_range_sizes_are_config_errors_naming_the_key(key: str, value: object) -> None:
    fields: dict[str, Any] = {"ssd": {"directory": "/nonexistent-kvtier-dir"}}
    if key.startswith("remote."):
        fields["remote"] = {"urls": "redis://127.0.0.1:1"}
    section, _, name = key.partition(".")
    fields.setdefault(section, {})[name] = value
    with pytest.raises(ConfigError, match=re.escape(f"`{key}`")):
        kvtier.Store(kvtier.StoreConfig(geometry=GEOMETRY, **fields))


def _numeric_fields() -> list[str]:
    """The key path of every StoreConfig key annotated int or float (optional or not), in the
    top level and in each section, plus the bandwidth list."""
    names = []
    sections = {"": kvtier.StoreConfig, "dram.": kvtier.DramConfig, "ssd.": kvtier.SsdConfig}
    for prefix, cls in {**sections, "remote.": kvtier.RemoteConfig}.items():
        for f in dataclasses.fields(cls):
            kinds = {t.strip() for t in str(f.type).split("|")}
            if f.init and kinds & {"int", "float"} and kinds <= {"int", "float", "None"}:
                names.append(prefix + f.name)
    return [*names, "ssd.bandwidth_bytes_per_s"]


def test_defect8_numeric_fields_are_all_covered() -> None:
    names = _numeric_fields()
    for expected in ("dram.capacity_bytes", "remote.inflight_bytes_max", "lease_ttl_s", "ssd.codec_level"):
        assert expected in names
    assert len(names) >= 20


# 1e30 bytes/s is a valid (f64) bandwidth: that one pair is not a case.
_HUGE_CASES = [
    pytest.param(key, value, id=f"{key}-{name}")
    for key in _numeric_fields()
    for value, name in ((10**30, "1e30"), (10**400, "1e400"), (10**5000, "1e5000"))
    if not (key == "ssd.bandwidth_bytes_per_s" and value == 10**30)
]


@pytest.mark.parametrize(("key", "value"), _HUGE_CASES)
def test_defect8_every_numeric_field_rejects_huge_ints_with_a_config_error(key: str, value: int) -> None:
    fields: dict[str, Any] = {
        "ssd": {"directory": "/nonexistent-kvtier-dir"},
        "remote": {"urls": "redis://127.0.0.1:1"},
    }
    section, _, name = key.rpartition(".")
    where = fields.setdefault(section, {}) if section else fields
    where[name] = (value,) if name == "bandwidth_bytes_per_s" else value
    if name == "codec_level":
        where["codec"] = "lossless"
    with pytest.raises(ConfigError, match=f"`{key}"):
        kvtier.Store(kvtier.StoreConfig(geometry=GEOMETRY, **fields))


def test_defect8_huge_geometry_fields_are_geometry_errors() -> None:
    with pytest.raises(GeometryError, match="`num_layers`"):
        kvtier.Geometry(10**5000, 1, 8)


# --- 9: YAML files ----------------------------------------------------------------------------------


def test_defect9_binary_yaml_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\x80\x81\xfe\xff\x00garbage")
    with pytest.raises(ConfigError, match="not UTF-8") as info:
        kvtier.StoreConfig.from_yaml(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("store: [unclosed\n", "not valid YAML"),
        ("a: b\x00\n", "not valid YAML"),
        ("[" * 100_000, "nests too deeply"),
        ("- a\n- b\n", "must hold a mapping"),
        ("42\n", "must hold a mapping"),
        ("", "must hold a mapping"),
        ("store: 5\n", "must hold a mapping"),
    ],
    ids=["syntax", "nul", "deep", "list", "scalar", "empty", "store-scalar"],
)
def test_defect9_yaml_errors_and_non_mappings_name_the_file(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "store.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle) as info:
        kvtier.StoreConfig.from_yaml(path)
    assert str(path) in str(info.value)


def test_defect9_yaml_with_non_string_keys_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "store.yaml"
    path.write_text("geometry: llama-3-8b\n1: one\nnull: nothing\n")
    with pytest.raises(ConfigError, match="unknown store config key"):
        kvtier.StoreConfig.from_yaml(path)


# --- 11: CLI user errors are one line -------------------------------------------------------------


def _kvtier() -> list[str]:
    script = Path(sys.executable).parent / "kvtier"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvtier.cli"]


def _user_error(*args: str, cwd: Path | None = None) -> str:
    """Runs ``kvtier args`` and returns its one stderr line, checking it is a clean user error."""
    proc = subprocess.run([*_kvtier(), *args], capture_output=True, text=True, timeout=120, cwd=cwd)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier: error: "), proc.stderr
    return lines[0]


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    return path


def test_defect11_bench_ssd_missing_directory_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "missing" / "x"
    line = _user_error("bench", "ssd", "--directory", str(missing), "--repeats", "1")
    assert "--directory" in line and str(missing) in line and "does not exist" in line


def test_defect11_bench_ssd_unwritable_directory_is_one_line(a_file: Path) -> None:
    # A path under a regular file cannot be written even by root.
    line = _user_error("bench", "ssd", "--directory", str(a_file / "sub"), "--repeats", "1")
    assert "--directory" in line and str(a_file / "sub") in line
    line = _user_error("bench", "ssd", "--directory", str(a_file), "--repeats", "1")
    assert "is not a directory" in line


@pytest.mark.parametrize(
    "command",
    [
        ["bench", "transfer", "--directory"],
        ["bench", "engine", "--repeats", "1", "--directory"],
        ["demo", "--engine", "--ssd-dir"],
    ],
    ids=["bench-transfer", "bench-engine", "demo-engine"],
)
def test_defect11_other_directory_flags_are_checked_first(command: list[str], a_file: Path) -> None:
    line = _user_error(*command, str(a_file / "sub"))
    assert str(a_file / "sub") in line


def test_defect11_bad_config_files_are_one_line(tmp_path: Path) -> None:
    assert "cannot read sim config" in _user_error("sim", "run", str(tmp_path / "missing.yaml"))
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x80")
    assert "not UTF-8" in _user_error("sim", "run", str(binary))


def test_defect11_bad_remote_url_is_one_line_without_the_password() -> None:
    line = _user_error("bench", "remote", "--no-cluster", "--url", f"redis://:{SECRET}@127.0.0.1:notaport")
    assert SECRET not in line and "--url" in line


def test_defect11_usage_errors_are_one_line() -> None:
    assert "--seed" in _user_error("demo", "--seed", "-1")
    assert "'x' is not an int" in _user_error("demo", "--conversations", "x")
    assert "required" in _user_error("bench")


SIM_CONFIG = (
    "name: tiny\nhardware: h100-sxm\nmodel: llama-3.1-8b\npolicy: {name: fcfs}\nblock_tokens: 16\n"
    "host_capacity_bytes: 10GiB\nworkload: {name: multiturn, num_sessions: 4, rate_per_s: 1.0}\n"
)


def test_defect11_unusable_output_paths_fail_before_the_work(tmp_path: Path, a_file: Path) -> None:
    config = tmp_path / "sim.yaml"
    config.write_text(SIM_CONFIG)
    line = _user_error("sim", "run", str(config), "--out", str(a_file / "result.json"))
    assert "--out" in line
    line = _user_error("sim", "sweep", str(config), "--rates", "1", "--out-dir", str(a_file / "sub"))
    assert str(a_file / "sub") in line and "Not a directory" in line


def test_defect11_os_errors_from_commands_are_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(args: object) -> None:
        raise PermissionError(13, "Permission denied", "/somewhere/file")

    monkeypatch.setattr(cli, "_bench_layout", refuse)
    assert cli.main(["bench", "layout"]) == 2
    assert capsys.readouterr().err == "kvtier: error: /somewhere/file: Permission denied\n"


@pytest.mark.parametrize("error", [ValueError("bug"), TypeError("bug"), KeyError("bug")])
def test_defect11_unexpected_errors_keep_their_traceback(
    error: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    def buggy(args: object) -> None:
        raise error

    monkeypatch.setattr(cli, "_bench_layout", buggy)
    with pytest.raises(type(error)):
        cli.main(["bench", "layout"])


# --- 7: a URL with an invalid host is a ConfigError, not a tier that opens "down" -------------


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1 :6379",
        "redis://ho\x00st:6379",
        "redis://a..b:1",
        "redis://[not-ipv6]:1",
        "redis://h\tx",
    ],
)
def test_defect7_an_invalid_host_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError, match="host"):
        kvtier.StoreConfig(geometry=GEOMETRY, remote={"urls": url})


def test_defect7_valid_hosts_still_parse() -> None:
    for url in ("redis://my_host-1.example.com.:1", "redis://[fe80::1]:6379", "redis://10.0.0.1"):
        kvtier.StoreConfig(geometry=GEOMETRY, remote={"urls": url})


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"geometry": "llama-3-8b", "dram": {"capacty_bytes": "1GiB"}}, "did you mean 'capacity_bytes'?"),
        ({"geometry": "llama-3-8b", "evicton": "lru"}, "did you mean 'eviction'?"),
        ({"geometry": "llama-3-8b", "eviction": "lruu"}, "did you mean 'lru'?"),
        ({"geometry": "llama-3-8"}, "did you mean 'llama-3-8b'?"),
    ],
)
def test_a_misspelt_store_config_name_gets_the_close_match(data: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        StoreConfig.from_dict(data)
