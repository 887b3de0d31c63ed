"""The nested StoreConfig (dram / ssd / remote sections, issue 18 step 5) and its one declarative
schema (issue 21 item 4): the nested form, the deprecated flat keys, and errors that name the key
path and the expected value; the engine integrations parse through the same schema."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

import kvtier
from kvtier.config import FLAT_KEYS
from kvtier.errors import ConfigError
from kvtier.integrations.sglang.config import BackendSettings, Parallelism
from kvtier.integrations.vllm.config import ConnectorSettings

GEOMETRY = kvtier.Geometry(2, 2, 8, "fp16", 4)
NESTED: dict[str, Any] = {
    "geometry": GEOMETRY.to_dict(),
    "model_id": "m",
    "eviction": "s3fifo",
    "dram": {"capacity_bytes": "1MiB", "prefault": True},
    "ssd": {"directory": "/nonexistent-kvtier-dir", "io_depth": 4, "codec": "lossless"},
    "remote": {
        "urls": "redis://alice:secret@127.0.0.1:1",
        "username": "alice",
        "password": "pw",
        "ttl_s": 60,
    },
}
FLAT: dict[str, Any] = {
    "geometry": GEOMETRY.to_dict(),
    "model_id": "m",
    "eviction": "s3fifo",
    "dram_capacity_bytes": "1MiB",
    "dram_prefault": True,
    "ssd_directory": "/nonexistent-kvtier-dir",
    "ssd_io_depth": 4,
    "ssd_codec": "lossless",
    "remote_urls": "redis://alice:secret@127.0.0.1:1",
    "remote_username": "alice",
    "remote_password": "pw",
    "remote_ttl_s": 60,
}


def test_nested_config_is_parsed_into_its_sections() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the nested form warns about nothing
        config = kvtier.StoreConfig.from_dict(NESTED)
    assert config.dram == kvtier.DramConfig(capacity_bytes=2**20, prefault=True)
    assert config.ssd is not None and config.ssd.io_depth == 4 and config.ssd.capacity_bytes == 8 * 2**30
    assert config.ssd.codec_backend == "zstd"  # lossless defaults to zstd
    assert config.remote is not None and config.remote.urls == ("redis://alice:secret@127.0.0.1:1",)
    assert config.remote.ttl_s == 60.0 and config.remote.write_through is True
    assert config.to_dict()["ssd"]["io_depth"] == 4
    assert kvtier.StoreConfig.from_dict(config.to_dict()) == config
    # Sections as objects or as mappings: the same config.
    built = kvtier.StoreConfig(
        geometry=GEOMETRY,
        model_id="m",
        eviction="s3fifo",
        dram=kvtier.DramConfig(capacity_bytes="1MiB", prefault=True),
        ssd=kvtier.SsdConfig(directory="/nonexistent-kvtier-dir", io_depth=4, codec="lossless"),
        remote=NESTED["remote"],
    )
    assert built == config


def test_absent_sections_mean_no_tier_and_dram_defaults() -> None:
    config = kvtier.StoreConfig(geometry=GEOMETRY)
    assert config.ssd is None and config.remote is None
    assert config.dram == kvtier.DramConfig() and config.dram.capacity_bytes == 4 * 2**30


def test_nested_yaml(tmp_path: Path) -> None:
    path = tmp_path / "store.yaml"
    path.write_text(
        "store:\n"
        "  geometry: llama-3-8b\n"
        "  dram: {capacity_bytes: 64MiB}\n"
        "  ssd:\n"
        "    directory: /nonexistent-kvtier-dir\n"
        "    durability: fsync\n"
    )
    config = kvtier.StoreConfig.from_yaml(path)
    assert config.dram.capacity_bytes == 64 * 2**20
    assert config.ssd is not None and config.ssd.durability == "fsync"


def test_flat_keys_still_work_with_a_warning_naming_each_new_key() -> None:
    with pytest.warns(DeprecationWarning) as caught:
        flat = kvtier.StoreConfig.from_dict(FLAT)
    assert flat == kvtier.StoreConfig.from_dict(NESTED)
    assert {w.filename for w in caught} == {__file__}  # each warning points at the caller's line
    named = {str(w.message) for w in caught}
    for old in ("dram_capacity_bytes", "ssd_io_depth", "remote_ttl_s"):
        assert any(f"`{old}` is deprecated" in m and f"use `{FLAT_KEYS[old]}`" in m for m in named), old
    assert FLAT_KEYS["ssd_io_depth"] == "ssd.io_depth" and FLAT_KEYS["dram_prefault"] == "dram.prefault"


def test_flat_attributes_still_read_with_a_warning() -> None:
    config = kvtier.StoreConfig.from_dict(NESTED)
    with pytest.warns(DeprecationWarning, match=r"use \.dram\.capacity_bytes"):
        assert config.dram_capacity_bytes == 2**20
    with pytest.warns(DeprecationWarning, match=r"use \.ssd\.io_depth"):
        assert config.ssd_io_depth == 4
    bare = kvtier.StoreConfig(geometry=GEOMETRY)
    with pytest.warns(DeprecationWarning):
        assert bare.ssd_directory is None and bare.remote_urls == ()
    with pytest.raises(AttributeError):
        _ = bare.no_such_key  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"ssd": {"directory": "/d", "io_depth": 0}},
            r"^`ssd\.io_depth` is 0; expected an int in \[1, 256\]$",
        ),
        ({"ssd": {"directory": "/d", "io_depth": True}}, r"`ssd\.io_depth` is True; expected an int"),
        (
            {"ssd": {"directory": "/d", "durability": "sync"}},
            r"`ssd\.durability` is 'sync' \(did you mean 'fsync'\?\); expected one of",
        ),
        ({"ssd": {"directory": "/d", "capacity": 1}}, r"unknown `ssd` section key\(s\) \['capacity'\]"),
        ({"ssd": {"io_depth": 4}}, r"`ssd\.directory` is missing; expected a directory path"),
        ({"remote": {"ttl_s": 5}}, r"`remote\.urls` is missing; expected a URL such as"),
        ({"ssd": "fast"}, r"`ssd` is 'fast'; expected a mapping of SsdConfig keys"),
        (
            {"dram": {"capacity_bytes": "4 parsecs"}},
            r"`dram\.capacity_bytes` is '4 parsecs'; expected a size",
        ),
        ({"dram": {"capacity_bytes": 100}}, r"`dram\.capacity_bytes` is 100; expected at least one block"),
        ({"remote": {"urls": []}}, r"`remote\.urls` has 0 URLs; expected 1 to 64"),
        (
            {"remote": {"urls": "redis://h", "io_timeout_s": 0}},
            r"`remote\.io_timeout_s` is 0; expected seconds",
        ),
        (
            {"remote": {"urls": ["redis://a", "redis://b"]}},
            r"`remote\.urls` has 2 URLs but `remote\.cluster` is false",
        ),
        ({"lease_ttl_s": -1}, r"`lease_ttl_s` is -1; expected a positive number of seconds"),
        ({"dram_capacity": 1}, r"unknown store config key\(s\) \['dram_capacity'\]"),
    ],
)
def test_errors_name_the_key_path_and_the_expected_value(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        kvtier.StoreConfig(geometry=GEOMETRY, **fields)


def test_a_flat_keys_error_names_the_key_as_given() -> None:
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(
            ConfigError, match=r"^`ssd\.io_depth` is 0; .* \(given as the deprecated `ssd_io_depth`\)$"
        ),
    ):
        kvtier.StoreConfig(geometry=GEOMETRY, ssd_directory="/d", ssd_io_depth=0)


def test_the_hint_names_only_the_flat_key_at_fault() -> None:
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError) as info:
        kvtier.StoreConfig(geometry=GEOMETRY, ssd_directory="/d", ssd_codec="lossless", ssd_codec_level=99)
    assert str(info.value).endswith("(given as the deprecated `ssd_codec_level`)")


def test_a_key_given_flat_and_nested_is_an_error() -> None:
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="both given; expected only"):
        kvtier.StoreConfig(geometry=GEOMETRY, ssd={"directory": "/d", "io_depth": 2}, ssd_io_depth=4)


def test_sections_check_their_own_keys_when_built_alone() -> None:
    with pytest.raises(ConfigError, match=r"`remote\.username` is set without `remote\.password`"):
        kvtier.RemoteConfig(urls="redis://h", username="alice")
    with pytest.raises(
        ConfigError, match=r"`ssd\.bandwidth_bytes_per_s` .* one number of bytes/s per device \(2\)"
    ):
        kvtier.SsdConfig(directory="/d", devices=["/a", "/b"], bandwidth_bytes_per_s=[1e9])
    assert "secret" not in repr(kvtier.RemoteConfig(urls="redis://:secret@h", password="secret"))


# --- the engine integrations parse through the same schema -------------------------------------


def test_vllm_extra_config_takes_the_nested_form(tmp_path: Path) -> None:
    f = tmp_path / "kvtier.yaml"
    f.write_text(
        "store:\n  dram: {capacity_bytes: 64MiB, prefault: false}\n  ssd: {directory: /d, io_depth: 2}\n"
    )
    s = ConnectorSettings.from_extra_config(
        {"config_file": str(f), "ssd": {"io_depth": 3}, "lookup_timeout_s": 1}
    )
    c = s.store_config(GEOMETRY, "m", None, "", 2, "test", 1)
    # The file's sections merge key by key under the inline ones; each TP rank gets its own pool.
    assert c.dram.capacity_bytes == 64 * 2**20 and c.dram.prefault is False
    assert c.ssd is not None and c.ssd.io_depth == 3 and c.ssd.directory == str(Path("/d") / "rank1")
    assert s.lookup_timeout_s == 1.0
    # A serving process prefaults its DRAM tier unless told otherwise.
    assert (
        ConnectorSettings.from_extra_config({}).store_config(GEOMETRY, "m", None, "", 1, "t", 0).dram.prefault
    )


def test_vllm_flat_extra_config_warns_and_still_works() -> None:
    with pytest.warns(
        DeprecationWarning,
        match=r"kv_connector_extra_config key `dram_capacity_bytes`.*`dram\.capacity_bytes`",
    ):
        s = ConnectorSettings.from_extra_config({"dram_capacity_bytes": "32MiB"})
    assert s.store_config(GEOMETRY, "m", None, "", 1, "t", 0).dram.capacity_bytes == 32 * 2**20


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"lookup_timeout_s": 0}, r"`lookup_timeout_s` is 0; expected seconds in \(0, 600\]"),
        ({"layerwise": "yes"}, r'`layerwise` is \'yes\'; expected true, false or "auto"'),
        ({"load_failure_policy": "ignore"}, r"`load_failure_policy` is 'ignore'; expected one of"),
        ({"ssd": {"capacity": 1}}, r"unknown `ssd` section key\(s\) \['capacity'\]"),
        ({"sdd": {}}, r"unknown kv_connector_extra_config key\(s\) \['sdd'\]"),
    ],
)
def test_vllm_errors_name_the_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ConnectorSettings.from_extra_config(extra).store_config(GEOMETRY, "m", None, "", 1, "t", 0)


def test_an_unknown_key_names_where_it_was_written_and_the_key_it_resembles(tmp_path: Path) -> None:
    f = tmp_path / "kvtier.yaml"
    f.write_text("store:\n  eviction: lru\n  leases_mx: 8\n")
    # A key of the config file is the file's, not the extra config's.
    with pytest.raises(
        ConfigError,
        match=rf"unknown `config_file` '{f}' key\(s\) \['leases_mx'\] \(did you mean 'leases_max'\?\); "
        r"expected StoreConfig keys \[",
    ):
        ConnectorSettings.from_extra_config({"config_file": str(f)})
    with pytest.raises(
        ConfigError,
        match=r"unknown kv_connector_extra_config key\(s\) \['lookup_timout_s'\] "
        r"\(did you mean 'lookup_timeout_s'\?\)",
    ):
        ConnectorSettings.from_extra_config({"lookup_timout_s": 1})
    with pytest.raises(ConfigError, match=r"\['copy_thread'\] \(did you mean 'copy_threads'\?\)"):
        BackendSettings.from_extra_config({"copy_thread": 1})


def test_sglang_extra_config_takes_the_nested_form_and_checks_it_at_once(tmp_path: Path) -> None:
    extra = {
        "backend_name": "kvtier",
        "dram": {"capacity_bytes": "2MiB"},
        "ssd": {"directory": str(tmp_path)},
    }
    settings = BackendSettings.from_extra_config(extra)
    config = settings.store_config(GEOMETRY, "m", Parallelism(tp_rank=1, tp_size=2), "page_first")
    assert config.dram.capacity_bytes == 2 * 2**20 and config.dram.prefault is True
    assert config.ssd is not None and Path(config.ssd.directory).name == "tp1of2-pp0of1-cp0of1"
    with pytest.raises(ConfigError, match=r"`ssd\.io_depth` is 0"):
        BackendSettings.from_extra_config({"ssd": {"directory": str(tmp_path), "io_depth": 0}})


def test_the_configuration_doc_lists_every_key() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    sections = {"": kvtier.StoreConfig, "dram.": kvtier.DramConfig, "ssd.": kvtier.SsdConfig}
    for prefix, cls in {**sections, "remote.": kvtier.RemoteConfig}.items():
        for name in cls.names():
            if name not in ("dram", "ssd", "remote"):
                assert f"`{prefix}{name}`" in doc, f"{prefix}{name} is not in docs/configuration.md"
