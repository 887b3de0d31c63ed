from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import ClassVar

import pytest

import kvtier
from kvtier.config import parse_size
from kvtier.errors import ConfigError
from kvtier.remote import RemotePool
from kvtier.schema import Section
from kvtier.transfer import TransferConfig, TransferEngine


def test_from_dict_with_preset_and_sizes() -> None:
    config = kvtier.StoreConfig.from_dict(
        {"geometry": "llama-3-8b", "model_id": "m", "dram": {"capacity_bytes": "512MiB"}, "eviction": "lru"}
    )
    assert config.dram.capacity_bytes == 512 * 2**20
    assert config.geometry.block_bytes == 2 * 2**20
    assert kvtier.StoreConfig.from_dict(config.to_dict()) == config


def test_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "store.yaml"
    path.write_text(
        "store:\n"
        "  model_id: demo\n"
        "  cache_salt: tenant-a\n"
        "  dram: {capacity_bytes: 1GiB}\n"
        "  geometry: {num_layers: 2, num_kv_heads: 2, head_dim: 8, dtype: fp16, block_tokens: 4}\n"
    )
    config = kvtier.StoreConfig.from_yaml(path)
    assert config.cache_salt == "tenant-a"
    assert config.geometry == kvtier.Geometry(2, 2, 8, "fp16", 4)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"geometry": "llama-3-8b", "dram_capacity": "1GiB"}, "unknown store config key"),
        ({"model_id": "m"}, "no `geometry`"),
        ({"geometry": "llama-3-8b", "dram": {"capacity_bytes": 0}}, "at least one block"),
        ({"geometry": "llama-3-8b", "dram": {"capacity_bytes": "-5GiB"}}, "size in bytes"),
        ({"geometry": "llama-3-8b", "dram": {"capacity_bytes": "4 parsecs"}}, "size in bytes"),
        ({"geometry": "llama-3-8b", "eviction": "random"}, "expected one of"),
        ({"geometry": "llama-3-8b", "lease_ttl_s": 0}, "positive"),
        ({"geometry": "llama-3-8b", "copy_threads": -1}, "copy_threads"),
        ({"geometry": "llama-3-8b", "model_id": ""}, "model_id"),
        ({"geometry": "llama-3-8b", "dram": {"prefault": "yes"}}, "dram.prefault"),
        ({"geometry": {"num_layers": 2}}, "missing"),
    ],
)
def test_bad_config_names_the_problem(data: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        kvtier.StoreConfig.from_dict(data)


def test_bad_yaml(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("store: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        kvtier.StoreConfig.from_yaml(path)
    with pytest.raises(ConfigError, match="cannot read"):
        kvtier.StoreConfig.from_yaml(tmp_path / "missing.yaml")


def test_parse_size() -> None:
    assert parse_size("4GiB", "x") == 4 * 2**30
    assert parse_size("1.5 GB", "x") == 1_500_000_000
    assert parse_size(123, "x") == 123
    with pytest.raises(ConfigError, match="`x`"):
        parse_size(True, "x")


def test_config_is_frozen() -> None:
    config = kvtier.StoreConfig(geometry=kvtier.Geometry(1, 1, 8))
    with pytest.raises(AttributeError):
        config.eviction = "s3fifo"  # type: ignore[misc]


LEASE_TTL_MAX_S = 365 * 24 * 3600  # kvtier_store::config::LEASE_TTL_MAX


@pytest.mark.parametrize(
    "ttl",
    [
        0,
        -1.0,
        1e-12,
        4e-10,
        float("inf"),
        float("nan"),
        1e20,
        pytest.param(10**400, id="10**400"),
        LEASE_TTL_MAX_S + 1e-6,
        "30",
    ],
)
def test_lease_ttl_out_of_the_stores_bounds_is_a_config_error(ttl: object) -> None:
    with pytest.raises(ConfigError, match="`lease_ttl_s`"):
        kvtier.StoreConfig(geometry=kvtier.Geometry(1, 1, 8), lease_ttl_s=ttl)  # type: ignore[arg-type]


@pytest.mark.parametrize("ttl", [1e-9, 6e-10, 0.5, 30, LEASE_TTL_MAX_S, float(LEASE_TTL_MAX_S)])
def test_lease_ttl_within_bounds_builds_a_store(ttl: float) -> None:
    config = kvtier.StoreConfig(
        geometry=kvtier.Geometry(1, 1, 8), dram=kvtier.DramConfig(capacity_bytes=2**16), lease_ttl_s=ttl
    )
    kvtier.Store(config)


@pytest.mark.parametrize("ttl", [1e20, float("inf"), float("nan"), 0.0, 1e-12, LEASE_TTL_MAX_S + 1.0])
def test_binding_rejects_bad_lease_ttl_without_panicking(ttl: float) -> None:
    # The Rust binding checks again (it may be called without StoreConfig): a ConfigError, not
    # a PanicException from Duration::from_secs_f64.
    g = kvtier.Geometry(1, 1, 8)
    with pytest.raises(ConfigError, match="lease_ttl_s"):
        kvtier._core.Store(core_config(g, lease_ttl_s=ttl))


def core_config(g: kvtier.Geometry, **top: object) -> dict[str, object]:
    """A mapping of ``StoreConfig``'s keys, which ``_core.Store`` takes as it takes the config itself."""
    base = {"geometry": g._handle, "model_id": "m", "cache_salt": "", "rank": 0, "layout_version": 1}
    return {**base, "copy_threads": 1, "leases_max": 16, "dram": {"capacity_bytes": 2**16}, **top}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_id": None}, "store config has no `model_id`"),
        ({"dram": {"capacity_bytes": "lots"}}, r"`dram\.capacity_bytes`: .*int"),
        ({"dram": 5}, r"`dram` is .*int.*; expected a mapping"),
        ({"ssd": {"directory": "/nonexistent", "io_depth": "deep"}}, r"`ssd\.io_depth`: "),
        ({"remote": {"urls": ["redis://h"], "connect_timeout_s": "fast"}}, r"`remote\.connect_timeout_s`: "),
        ({"remote": {"urls": ["redis://h"], "tls_ca_file": 5}}, r"`remote\.tls_ca_file`: "),
        ({"remote": {"urls": ["redis://h"], "codec": "gzip"}}, r"remote\.codec is"),
        ({"geometry": "llama-3-8b"}, "`geometry`"),
    ],
)
def test_binding_parses_the_one_nested_mapping_naming_bad_keys(
    change: dict[str, object], message: str
) -> None:
    # The whole config crosses into Rust as one mapping; what Python did not check (it may be
    # called without StoreConfig) is a ConfigError naming the key path, never a panic.
    with pytest.raises(ConfigError, match=message):
        kvtier._core.Store(core_config(kvtier.Geometry(1, 1, 8), **change))


def test_binding_takes_the_store_config_itself() -> None:
    config = kvtier.StoreConfig(
        geometry=kvtier.Geometry(1, 1, 8), model_id="m", dram={"capacity_bytes": 2**16}
    )
    core = kvtier._core.Store(config)
    assert bytes(core.namespace_hash) == config.namespace.hash
    assert core.block_bytes == config.geometry.block_bytes


@pytest.mark.parametrize("config", [5, "store.yaml", [("model_id", "m")]])
def test_binding_refuses_a_config_that_is_neither_mapping_nor_dataclass(config: object) -> None:
    with pytest.raises(ConfigError, match=r"store config is .*; expected a mapping or a kvtier\.StoreConfig"):
        kvtier._core.Store(config)  # type: ignore[arg-type]


def test_binding_refuses_a_config_dataclass_of_another_class(tmp_path: Path) -> None:
    # Read by attribute, another config's dataclass would give the keys it shares and leave the
    # rest at the Rust defaults, silently (a TransferConfig has no required key at all).
    geometry = kvtier.Geometry(1, 1, 8)
    store = kvtier._core.Store(core_config(geometry))
    ssd = kvtier.SsdConfig(directory=str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"transfer config is .*SsdConfig.*; expected a mapping or a kvtier\.TransferConfig"
    ):
        kvtier._core.TransferEngine(store, ssd)  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match=r"`ssd` is .*TransferConfig.*; expected a mapping or a kvtier\.SsdConfig"
    ):
        kvtier._core.SsdPool(kvtier.TransferConfig())  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match=r"`ssd` is .*DramConfig.*; expected a mapping or a kvtier\.SsdConfig"
    ):
        kvtier._core.Store(core_config(geometry, ssd=kvtier.DramConfig()))  # type: ignore[arg-type]


class Recording:
    """A config section that records every key the binding reads from it, under the section's
    path, and answers from ``section``. Built by :func:`recording`, which passes the binding's
    dataclass check by naming its class as the section's."""

    __dataclass_fields__: ClassVar[dict[str, object]] = {}

    def __init__(self, section: object, path: str, read: set[str]) -> None:
        self._section, self._path, self._read = section, path, read

    def __getattr__(self, key: str) -> object:
        self._read.add(f"{self._path}{key}")
        value = getattr(self._section, key, None)
        if isinstance(value, Section):
            return recording(value, f"{key}.", self._read)
        return value


def recording(section: object, path: str, read: set[str]) -> Recording:
    cls = type(type(section).__name__, (Recording,), {})
    return cls(section, path, read)  # type: ignore[no-any-return]


def test_binding_reads_every_key_python_declares_by_its_name(tmp_path: Path) -> None:
    # The sections cross as objects and Rust reads each key by name: a key Python declares that the
    # binding never reads (or reads misspelt) would be silently left at the Rust default.
    config = kvtier.StoreConfig(
        geometry=kvtier.Geometry(1, 1, 8),
        dram={"capacity_bytes": 2**16},
        ssd={"directory": str(tmp_path), "capacity_bytes": 2**20, "probe_bytes": 0},
        remote={"urls": "redis://127.0.0.1:1", "connect_timeout_s": 0.01},
    )
    read: set[str] = set()
    with contextlib.suppress(kvtier.KvtierError):  # the keys are read before any tier opens
        kvtier._core.Store(recording(config, "", read))  # type: ignore[arg-type]
    declared = {f.name for f in dataclasses.fields(config) if f.init} - {"metrics_port", "metrics_addr"}
    for name in ("dram", "ssd", "remote"):
        declared |= {f"{name}.{f.name}" for f in dataclasses.fields(getattr(config, name))}
    pool_only = {"ssd.throttle_bytes_per_s", "ssd.min_object_bytes", "ssd.compact_min_records"}
    assert read - pool_only == declared


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lease_ttl": 3.0}, r"unknown store config key\(s\) `lease_ttl` \(did you mean 'lease_ttl_s'\?\)"),
        ({"dram": {"capacity_byte": 2**16}}, r"`dram\.capacity_byte` \(did you mean 'capacity_bytes'\?\)"),
        (
            {"dram": {"capacity_bytes": 2**16, 7: 1}},
            r"`dram\.7`; expected some of \{\"capacity_bytes\", \"prefault\"\}",
        ),
        (
            {"ssd": {"directory": "/nonexistent", "admision_k": 2}},
            r"`ssd\.admision_k` \(did you mean 'admission_k'\?\)",
        ),
        (
            {"remote": {"urls": ["redis://h"], "codecs": "raw"}},
            r"`remote\.codecs` \(did you mean 'codec'\?\)",
        ),
    ],
)
def test_binding_refuses_a_mapping_key_it_does_not_read(change: dict[object, object], message: str) -> None:
    # A misspelt key would otherwise leave its setting at the default, silently.
    with pytest.raises(ConfigError, match=message):
        kvtier._core.Store(core_config(kvtier.Geometry(1, 1, 8), **change))  # type: ignore[arg-type]


def test_pools_and_engines_refuse_a_mapping_key_they_do_not_read(tmp_path: Path) -> None:
    ssd = {"directory": str(tmp_path), "capacity_bytes": 2**22, "probe_bytes": 0}
    with pytest.raises(ConfigError, match=r"`ssd\.capacity_byte` \(did you mean 'capacity_bytes'\?\)"):
        kvtier._core.SsdPool({**ssd, "capacity_byte": 2**22})
    with pytest.raises(ConfigError, match=r"unknown ssd config key\(s\) `ssd\.admission_k`"):
        kvtier._core.SsdPool({**ssd, "admission_k": 2})  # the store admits; a pool alone does not
    kvtier._core.SsdPool(ssd).close()
    for remote_pool in (kvtier._core.RemotePool, RemotePool):
        with pytest.raises(ConfigError, match=r"`remote\.clustr` \(did you mean 'cluster'\?\)"):
            remote_pool({"urls": ["redis://127.0.0.1:1"], "clustr": True}, bytes(16))  # type: ignore[arg-type]
    store = kvtier.Store(
        kvtier.StoreConfig(geometry=kvtier.Geometry(1, 1, 8), dram={"capacity_bytes": 2**16})
    )
    with pytest.raises(ConfigError, match=r"unknown transfer config key\(s\) `chunk_block` \(did you mean"):
        kvtier._core.TransferEngine(store._core, {"chunk_block": 2})
    with pytest.raises(ConfigError, match=r"\['chunk_block'\] \(did you mean 'chunk_blocks'\?\)"):
        TransferEngine(store, {"chunk_block": 2})
    with pytest.raises(TypeError, match="TransferEngine's config is a SsdConfig; expected a TransferConfig"):
        TransferEngine(store, kvtier.SsdConfig(directory=str(tmp_path)))  # type: ignore[arg-type]
    assert TransferEngine(store, {"chunk_blocks": 2}).config == TransferConfig(chunk_blocks=2)
    kvtier._core.TransferEngine(store._core, {"chunk_blocks": 2, "stage_workers": [1, 2, 1, 1]})


@pytest.mark.parametrize("capacity", [2**70, 2**64, 2**63, "20000000TiB"])
def test_capacity_beyond_the_address_space_is_a_config_error(capacity: object) -> None:
    with pytest.raises(ConfigError, match=r"`dram\.capacity_bytes`"):
        kvtier.StoreConfig(geometry=kvtier.Geometry(1, 1, 8), dram={"capacity_bytes": capacity})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model_id", "m" * 4097),
        ("cache_salt", "s" * 4097),
        ("cache_salt", "é" * 2049),
        ("model_id", "\ud800"),
    ],
)
def test_namespace_fields_too_long_or_unencodable_are_config_errors(field: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"`{field}`"):
        kvtier.StoreConfig(geometry=kvtier.Geometry(1, 1, 8), **{field: value})  # type: ignore[arg-type]


def test_namespace_fields_of_exactly_4096_bytes_are_fine() -> None:
    config = kvtier.StoreConfig(geometry=kvtier.Geometry(1, 1, 8), model_id="m" * 4096, cache_salt="é" * 2048)
    assert len(config.namespace.hash) == 16
