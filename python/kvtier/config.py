"""Store configuration: a frozen, validated dataclass, built in code, from a dict, or from YAML.

Unknown keys are errors (a misspelt key silently ignored is a misconfigured cache). Sizes may be
ints (bytes) or strings with a unit: ``"512MiB"``, ``"4GiB"``, ``"1.5GB"``.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

from kvtier.errors import ConfigError
from kvtier.geometry import Geometry
from kvtier.keys import Namespace

EVICTION_POLICIES = ("lru", "s3fifo")

# Bounds the Rust store enforces (crates/kvtier-store/src/config.rs), checked here first so a bad
# value is a ConfigError naming the field before any Rust code runs.
#: Longest lease TTL: ``LEASE_TTL_MAX``, 365 days.
LEASE_TTL_MAX_S = 365 * 24 * 3600
#: Largest DRAM tier: ``DRAM_CAPACITY_BYTES_MAX``, ``isize::MAX`` (what one mapping may span).
DRAM_CAPACITY_BYTES_MAX = sys.maxsize
#: Longest ``model_id`` / ``cache_salt`` in UTF-8 bytes: ``NAMESPACE_FIELD_BYTES_MAX`` (kvtier-core).
NAMESPACE_FIELD_BYTES_MAX = 4096

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(value: object, name: str) -> int:
    """Bytes from an int or a string such as ``"4GiB"``; raises :class:`ConfigError` naming ``name``."""
    if isinstance(value, bool):
        raise ConfigError(f"`{name}` is {value!r}; expected a size in bytes such as 4294967296 or '4GiB'")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ConfigError(f"`{name}` is {value!r}; expected a size in bytes such as 4294967296 or '4GiB'")


@dataclass(frozen=True)
class StoreConfig:
    """Everything a :class:`kvtier.Store` needs. Validated at construction."""

    geometry: Geometry
    model_id: str = "unnamed-model"
    cache_salt: str = ""
    rank: int = 0
    layout_version: int = 1
    dram_capacity_bytes: int = 4 * 2**30
    eviction: str = "lru"
    copy_threads: int = 0
    lease_ttl_s: float = 30.0
    leases_max: int = 4096
    dram_prefault: bool = False
    namespace: Namespace = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.geometry, Geometry):
            raise ConfigError(f"`geometry` is {type(self.geometry).__name__}; expected kvtier.Geometry")
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ConfigError(f"`model_id` is {self.model_id!r}; expected a non-empty string")
        if not isinstance(self.cache_salt, str):
            raise ConfigError(f"`cache_salt` is {self.cache_salt!r}; expected a string")
        _namespace_field("model_id", self.model_id)
        _namespace_field("cache_salt", self.cache_salt)
        capacity = parse_size(self.dram_capacity_bytes, "dram_capacity_bytes")
        if capacity < self.geometry.block_bytes:
            raise ConfigError(
                f"`dram_capacity_bytes` is {capacity}; expected at least one block "
                f"({self.geometry.block_bytes} bytes)"
            )
        if capacity > DRAM_CAPACITY_BYTES_MAX:
            raise ConfigError(
                f"`dram_capacity_bytes` is {capacity}; expected at most {DRAM_CAPACITY_BYTES_MAX} "
                f"(the largest memory this machine can map)"
            )
        object.__setattr__(self, "dram_capacity_bytes", capacity)
        if self.eviction not in EVICTION_POLICIES:
            raise ConfigError(f"`eviction` is {self.eviction!r}; expected one of {list(EVICTION_POLICIES)}")
        _int_in("copy_threads", self.copy_threads, 0, 256)
        _int_in("leases_max", self.leases_max, 1, 2**24)
        _int_in("rank", self.rank, 0, 2**32 - 1)
        _int_in("layout_version", self.layout_version, 0, 2**32 - 1)
        if not isinstance(self.dram_prefault, bool):
            raise ConfigError(f"`dram_prefault` is {self.dram_prefault!r}; expected true or false")
        _check_lease_ttl(self.lease_ttl_s)
        namespace = Namespace(self.model_id, self.geometry, self.cache_salt, self.rank, self.layout_version)
        object.__setattr__(self, "namespace", namespace)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StoreConfig:
        """From a mapping; ``geometry`` may be a mapping or a preset name such as ``"llama-3-8b"``."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"store config must be a mapping; got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown store config key(s) {unknown}; expected some of {sorted(known)}")
        if "geometry" not in data:
            raise ConfigError("store config has no `geometry`; expected a mapping or a preset name")
        fields = dict(data)
        fields["geometry"] = Geometry.from_dict(fields["geometry"])
        return cls(**fields)

    @classmethod
    def from_yaml(cls, path: str | Path) -> StoreConfig:
        """From a YAML file holding the mapping :meth:`from_dict` takes (optionally under ``store:``)."""
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read store config {str(path)!r}: {e.strerror}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"store config {str(path)!r} is not valid YAML: {e}") from None
        if isinstance(data, Mapping) and set(data) == {"store"}:
            data = data["store"]
        if not isinstance(data, Mapping):
            raise ConfigError(f"store config {str(path)!r} must hold a mapping; got {type(data).__name__}")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        out["geometry"] = self.geometry.to_dict()
        return out


def _check_lease_ttl(ttl: object) -> None:
    """The Rust store's bounds: more than 0 once rounded to whole nanoseconds (as Rust's
    ``Duration::try_from_secs_f64`` rounds), at most :data:`LEASE_TTL_MAX_S`. Rejects NaN, infinities
    and ints too large for a float without converting them."""
    ok = (
        not isinstance(ttl, bool)
        and isinstance(ttl, int | float)
        and 0 < ttl <= LEASE_TTL_MAX_S  # False for NaN; no float conversion of huge ints
        and Fraction(ttl) * 10**9 >= Fraction(1, 2)  # rounds to at least 1 ns (ties cannot occur)
    )
    if not ok:
        raise ConfigError(
            f"`lease_ttl_s` is {ttl!r}; expected a positive number of seconds (at least 1 ns once "
            f"rounded to nanoseconds) and at most {LEASE_TTL_MAX_S} ({LEASE_TTL_MAX_S // 86400} days)"
        )


def _namespace_field(name: str, value: str) -> None:
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise ConfigError(f"`{name}` cannot be encoded as UTF-8 ({e.reason}); expected text") from None
    if size > NAMESPACE_FIELD_BYTES_MAX:
        raise ConfigError(
            f"`{name}` is {size} bytes in UTF-8 ({value[:32]!r}...); expected at most "
            f"{NAMESPACE_FIELD_BYTES_MAX} bytes"
        )


def _int_in(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"`{name}` is {value!r}; expected an int in [{lo}, {hi}]")
