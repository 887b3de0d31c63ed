"""Store configuration: a frozen, validated dataclass with ``dram``, ``ssd`` and ``remote`` sections
(as the Rust store has them), built in code, from a dict, or from YAML::

    StoreConfig(geometry=Geometry.llama3_8b(), dram=DramConfig(capacity_bytes="1GiB"),
                ssd=SsdConfig(directory="/mnt/nvme/kvtier"))
    StoreConfig.from_dict({"geometry": "llama-3-8b", "dram": {"capacity_bytes": "1GiB"},
                           "ssd": {"directory": "/mnt/nvme/kvtier"}})

Every key is declared once with its check (:mod:`kvtier.schema`, :mod:`kvtier.config_sections`);
unknown keys are errors (a misspelt key silently ignored is a misconfigured cache), and every
error is a :class:`ConfigError` naming the key path and the expected value. Sizes may be ints
(bytes) or strings with a unit: ``"512MiB"``, ``"4GiB"``, ``"1.5GB"``.

The flat keys of earlier releases (``dram_capacity_bytes``, ``ssd_directory``, ``remote_urls``,
...) still work for one release, each with a DeprecationWarning naming its new key
(``dram.capacity_bytes``, ``ssd.directory``, ``remote.urls``): see :data:`FLAT_KEYS`.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import yaml

from kvtier.config_sections import DramConfig, RemoteConfig, SsdConfig
from kvtier.errors import ConfigError, shown
from kvtier.geometry import Geometry
from kvtier.keys import Namespace
from kvtier.schema import (
    U64_MAX,
    Section,
    choice,
    integer,
    key,
    nest_flat_keys,
    optional,
    parse_size,
    section,
    text,
)

__all__ = ["U64_MAX", "DramConfig", "RemoteConfig", "SsdConfig", "StoreConfig", "parse_size", "read_yaml"]

#: Longest lease TTL: ``LEASE_TTL_MAX``, 365 days.
LEASE_TTL_MAX_S = 365 * 24 * 3600
#: Longest ``model_id`` / ``cache_salt`` in UTF-8 bytes: ``NAMESPACE_FIELD_BYTES_MAX`` (kvtier-core).
NAMESPACE_FIELD_BYTES_MAX = 4096
#: Bytes of a stored object's header; objects take whole 4 KiB pages (docs/formats.md).
OBJECT_HEADER_BYTES = 64
PAGE_BYTES = 4096
#: The flat keys of earlier releases -> their key paths (deprecated; they go in the next release).
FLAT_KEYS: dict[str, str] = {
    "dram_capacity_bytes": "dram.capacity_bytes",
    "dram_prefault": "dram.prefault",
    **{f"ssd_{k}": f"ssd.{k}" for k in SsdConfig.names()},
    **{f"remote_{k}": f"remote.{k}" for k in RemoteConfig.names()},
}


def read_yaml(path: str | Path, what: str) -> Any:
    """The parsed contents of a YAML file; unreadable, non-UTF-8 or invalid files raise
    :class:`ConfigError` naming ``what`` and the path."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read {what} {str(path)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{what} {str(path)!r} is not UTF-8 text (byte {e.start}); expected a YAML file"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML: {e}") from None
    except RecursionError:
        raise ConfigError(
            f"{what} {str(path)!r} nests too deeply to parse; expected a YAML mapping"
        ) from None


def _geometry(value: Any, path: str) -> Geometry:
    if isinstance(value, Geometry):
        return value
    if isinstance(value, Mapping | str):
        return Geometry.from_dict(value)
    raise ConfigError(
        f"`{path}` is {type(value).__name__}; expected kvtier.Geometry, a mapping or a preset name"
    )


def _namespace_text(nonempty: bool) -> Any:
    what = "a non-empty string" if nonempty else "a string"

    def check(value: Any, path: str) -> str:
        value = text(nonempty, what)(value, path)
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise ConfigError(f"`{path}` cannot be encoded as UTF-8 ({e.reason}); expected text") from None
        if size > NAMESPACE_FIELD_BYTES_MAX:
            raise ConfigError(
                f"`{path}` is {size} bytes in UTF-8 ({value[:32]!r}...); expected at most "
                f"{NAMESPACE_FIELD_BYTES_MAX} bytes"
            )
        return str(value)

    return check


def _lease_ttl(ttl: Any, path: str) -> float:
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
            f"`{path}` is {shown(ttl)}; expected a positive number of seconds (at least 1 ns once "
            f"rounded to nanoseconds) and at most {LEASE_TTL_MAX_S} ({LEASE_TTL_MAX_S // 86400} days)"
        )
    return ttl  # type: ignore[no-any-return]


@dataclass(frozen=True, kw_only=True)
class StoreConfig(Section):
    """Everything a :class:`kvtier.Store` needs. Validated at construction."""

    LABEL: ClassVar[str] = "store config"
    geometry: Geometry = key(_geometry)
    model_id: str = key(_namespace_text(True), "unnamed-model")
    cache_salt: str = key(_namespace_text(False), "")
    rank: int = key(integer(0, 2**32 - 1), 0)
    layout_version: int = key(integer(0, 2**32 - 1), 1)
    #: DRAM's eviction policy (the SSD pool evicts by it too).
    eviction: str = key(choice("lru", "s3fifo"), "lru")
    #: Workers copying objects in put/load (0: one per core).
    copy_threads: int = key(integer(0, 256), 0)
    #: How long a lease pins its blocks if it is never released.
    lease_ttl_s: float = key(_lease_ttl, 30.0)
    leases_max: int = key(integer(1, 2**24), 4096)
    #: Serve Prometheus metrics of this store on ``http://metrics_addr:metrics_port/metrics``
    #: (docs/metrics.md); ``None``: no endpoint. Stores of one process may share a port.
    metrics_port: int | None = key(optional(integer(1, 65535)), None)
    metrics_addr: str = key(text(nonempty=True, what="a host address"), "127.0.0.1")
    dram: DramConfig = key(section(DramConfig, absent=DramConfig()), DramConfig())
    #: The SSD tier below DRAM; ``None``: none.
    ssd: SsdConfig | None = key(section(SsdConfig), None)
    #: The remote tier below DRAM (and SSD); ``None``: none. See ``docs/remote.md``.
    remote: RemoteConfig | None = key(section(RemoteConfig), None)
    namespace: Namespace = field(init=False, repr=False, compare=False)

    def check(self) -> None:
        g = self.geometry
        if self.dram.capacity_bytes < g.block_bytes:
            raise ConfigError(
                f"`dram.capacity_bytes` is {self.dram.capacity_bytes}; expected at least one block "
                f"({g.block_bytes} bytes)"
            )
        if self.ssd is not None:
            n = max(1, len(self.ssd.devices))
            size = self.ssd_object_bytes
            if self.ssd.capacity_bytes < n * size:
                raise ConfigError(
                    f"`ssd.capacity_bytes` is {self.ssd.capacity_bytes}; expected at least one "
                    f"{size}-byte object per device ({n} x {size} = {n * size} bytes)"
                )
        for tier in (self.ssd, self.remote):
            if tier is not None and tier.codec == "quant" and (g.dtype != "fp16" or g.extra_groups):
                raise ConfigError(
                    f"`{tier.key_path('codec')}` is 'quant', which needs fp16 KV with no extra groups; "
                    f"the geometry is {g.dtype} with {len(g.extra_groups)} extra group(s) (use 'lossless' or 'raw')"
                )
        namespace = Namespace(self.model_id, g, self.cache_salt, self.rank, self.layout_version)
        object.__setattr__(self, "namespace", namespace)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StoreConfig:
        """From a mapping (nested sections, or the deprecated flat keys); ``geometry`` may be a
        mapping or a preset name such as ``"llama-3-8b"``."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"store config must be a mapping; got {type(data).__name__}")
        if "geometry" not in data:
            raise ConfigError("store config has no `geometry`; expected a mapping or a preset name")
        cls.check_known(data, also=FLAT_KEYS)  # before ** (YAML keys may be ints, None, ...)
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> StoreConfig:
        """From a YAML file holding the mapping :meth:`from_dict` takes (optionally under ``store:``)."""
        data = read_yaml(path, "store config")
        if isinstance(data, Mapping) and set(data) == {"store"}:
            data = data["store"]
        if not isinstance(data, Mapping):
            raise ConfigError(f"store config {str(path)!r} must hold a mapping; got {type(data).__name__}")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """Nested plain data (the real remote URLs and password included): from_dict's input."""
        out = super().to_dict()
        out["geometry"] = self.geometry.to_dict()
        return out

    @property
    def object_bytes(self) -> int:
        """Bytes one block takes in DRAM: payload + 64-byte header, rounded up to whole pages."""
        return -(-(OBJECT_HEADER_BYTES + self.geometry.block_bytes) // PAGE_BYTES) * PAGE_BYTES

    @property
    def ssd_object_bytes(self) -> int:
        """Bytes one block takes on an SSD device: the payload rounded up to whole pages."""
        return max(1, -(-self.geometry.block_bytes // PAGE_BYTES)) * PAGE_BYTES

    if not TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any:
            """The deprecated flat attributes (``config.ssd_directory``: ``config.ssd.directory``)."""
            new = FLAT_KEYS.get(name)
            if new is None:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            warnings.warn(f"StoreConfig.{name} is deprecated; use .{new}", DeprecationWarning, stacklevel=2)
            sec, _, rest = new.partition(".")
            part = object.__getattribute__(self, sec)
            if part is None:  # no such tier: the section's default (None, (), ...)
                default = _SECTIONS[sec].__dataclass_fields__[rest].default
                if default is MISSING:  # as the flat keys had it: no directory, no URLs
                    return () if rest == "urls" else None
                return default
            return getattr(part, rest)


_SECTIONS: dict[str, type[Section]] = {"dram": DramConfig, "ssd": SsdConfig, "remote": RemoteConfig}
_dataclass_init = StoreConfig.__init__


def nest_store_keys(data: Mapping[str, Any], what: str = "store config") -> tuple[dict[str, Any], list[str]]:
    """``data`` with the deprecated flat keys moved into their sections (each with a
    DeprecationWarning naming the new key, :func:`kvtier.schema.nest_flat_keys`), and the flat keys
    that were given. As before the sections, flat SSD keys without ``ssd_directory`` make no SSD
    tier (they are checked all the same) and flat remote keys without ``remote_urls`` no remote tier."""
    flat = [k for k in data if k in FLAT_KEYS]
    if not flat:
        return dict(data), []
    out = nest_flat_keys(data, FLAT_KEYS, what)
    ssd, remote = out.get("ssd"), out.get("remote")
    if isinstance(ssd, Mapping) and ssd.get("directory") is None and "ssd" not in data:
        if ssd.get("devices"):
            raise ConfigError(
                "`ssd_devices` is set but `ssd_directory` is None; expected a directory for the index "
                "log (or drop ssd_devices)"
            )
        with_flat_hint(flat, lambda: SsdConfig.from_dict({**ssd, "directory": "-"}))
        del out["ssd"]
    if isinstance(remote, Mapping) and not remote.get("urls") and "remote" not in data:
        with_flat_hint(flat, lambda: RemoteConfig.from_dict({**remote, "urls": "redis://127.0.0.1"}))
        del out["remote"]
    return out, flat


T = TypeVar("T")


def with_flat_hint(flat: list[str], build: Callable[[], T]) -> T:
    """``build()``; a ConfigError naming the new path of a deprecated flat key in ``flat`` also
    names that key (the one the user wrote)."""
    try:
        return build()
    except ConfigError as e:
        raise flat_hint(flat, e) from None


def flat_hint(flat: list[str], error: ConfigError) -> ConfigError:
    """``error``, or, where it names the new path of a deprecated flat key in ``flat``, a
    ConfigError that also names that key."""
    names = [old for old in flat if re.search(rf"`{re.escape(FLAT_KEYS[old])}[`\[]", str(error))]
    if not names:
        return error
    given = ", ".join(f"`{n}`" for n in names)
    return ConfigError(f"{error} (given as the deprecated {given})")


def _init(self: StoreConfig, **kwargs: Any) -> None:
    """StoreConfig's constructor: the dataclass one, after the deprecated flat keys are moved into
    their sections (:func:`nest_store_keys`)."""
    StoreConfig.check_known(kwargs, also=FLAT_KEYS)
    data, flat = nest_store_keys(kwargs)
    with_flat_hint(flat, lambda: _dataclass_init(self, **data))


StoreConfig.__init__ = _init  # type: ignore[method-assign]
