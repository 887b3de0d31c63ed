"""Store configuration: a frozen, validated dataclass, built in code, from a dict, or from YAML.

Unknown keys are errors (a misspelt key silently ignored is a misconfigured cache). Sizes may be
ints (bytes) or strings with a unit: ``"512MiB"``, ``"4GiB"``, ``"1.5GB"``.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path, PurePath
from typing import Any

import yaml

from kvtier.errors import ConfigError, shown
from kvtier.geometry import Geometry
from kvtier.keys import Namespace
from kvtier.remote import check_remote, normalize_urls, redact_url, remote_options

EVICTION_POLICIES = ("lru", "s3fifo")
SSD_DURABILITY = ("none", "fsync")
SSD_PLACEMENTS = ("bandwidth", "round_robin")
SSD_IO_ENGINES = ("auto", "io_uring", "pread")

# Bounds the Rust store enforces (crates/kvtier-store/src/config.rs), checked here first so a bad
# value is a ConfigError naming the field before any Rust code runs.
#: Longest lease TTL: ``LEASE_TTL_MAX``, 365 days.
LEASE_TTL_MAX_S = 365 * 24 * 3600
#: Largest DRAM tier: ``DRAM_CAPACITY_BYTES_MAX``, ``isize::MAX`` (what one mapping may span).
DRAM_CAPACITY_BYTES_MAX = sys.maxsize
#: Longest ``model_id`` / ``cache_salt`` in UTF-8 bytes: ``NAMESPACE_FIELD_BYTES_MAX`` (kvtier-core).
NAMESPACE_FIELD_BYTES_MAX = 4096
#: SSD pool bounds (crates/kvtier-pool/src/ssd/config.rs, kvtier-store/src/config.rs).
SSD_DEVICES_MAX = 64
SSD_IO_DEPTH_MAX = 256
SSD_PROBE_BYTES_MAX = 4 * 2**30
SSD_ADMISSION_K_MAX = 2**20
#: Largest size any field takes (the Rust side holds sizes as ``u64``).
U64_MAX = 2**64 - 1
#: Bytes of a stored object's header; objects take whole 4 KiB pages (docs/formats.md).
OBJECT_HEADER_BYTES = 64
PAGE_BYTES = 4096

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


_SIZE = re.compile(r"\s*([0-9]+)(?:\.([0-9]+))?\s*([a-zA-Z]*)\s*")
#: Most digits after the point a size string may have (each one is exact, none is rounded away).
_SIZE_FRACTION_DIGITS_MAX = 64


def parse_size(value: object, name: str, hi: int = U64_MAX) -> int:
    """Bytes from an int or a string such as ``"4GiB"`` or ``"1.5GB"`` (computed exactly, rounded
    down to whole bytes), at most ``hi``; raises :class:`ConfigError` naming ``name``."""
    size: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str):
        m = _SIZE.fullmatch(value)
        if m and m.group(3).lower() in _UNITS:
            whole, fraction = m.group(1).lstrip("0"), (m.group(2) or "").rstrip("0")
            if len(whole) > len(str(hi)):  # more digits than hi: too large (no huge int built)
                raise ConfigError(f"`{name}` is {shown(value)}; expected a size of at most {hi} bytes")
            if len(fraction) <= _SIZE_FRACTION_DIGITS_MAX:
                scale = 10 ** len(fraction)
                size = (
                    (int(whole or "0") * scale + int(fraction or "0")) * _UNITS[m.group(3).lower()] // scale
                )
    if size is None or size < 0:
        raise ConfigError(
            f"`{name}` is {shown(value)}; expected a size in bytes such as 4294967296 or '4GiB'"
        )
    if size > hi:
        raise ConfigError(f"`{name}` is {shown(value)}; expected a size of at most {hi} bytes")
    return size


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
    #: Serve Prometheus metrics of this store on ``http://metrics_addr:metrics_port/metrics``
    #: (docs/metrics.md); ``None``: no endpoint. Stores of one process may share a port.
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    #: The SSD tier below DRAM: a directory holding its index log, bandwidth cache and lock (and
    #: its one device file when ``ssd_devices`` is empty). ``None``: DRAM only.
    ssd_directory: str | None = None
    #: Device paths (raw block devices, or files created and pre-allocated there).
    ssd_devices: tuple[str, ...] = ()
    #: Object space over all devices, split equally (used when the pool is created).
    ssd_capacity_bytes: int = 8 * 2**30
    #: When ``put`` returns for SSD writes: ``"none"`` (written, logged in the page cache) or
    #: ``"fsync"`` (data and index on stable storage).
    ssd_durability: str = "none"
    #: A block is written to SSD only after this many accesses (its put is one, each lease one more).
    ssd_admission_k: int = 1
    #: ``"bandwidth"`` (Unified KV pooling, Algorithm 1) or ``"round_robin"``.
    ssd_placement: str = "bandwidth"
    #: Bytes/s per device, instead of the start-up probe.
    ssd_bandwidth_bytes_per_s: tuple[float, ...] | None = None
    ssd_io_engine: str = "auto"
    ssd_io_depth: int = 8
    #: Bytes the bandwidth probe writes and reads per device (0: no probe, equal shares).
    ssd_probe_bytes: int = 64 * 2**20
    #: Also write blocks to SSD when they are put (default: when DRAM evicts them).
    ssd_write_through: bool = False
    #: Copy blocks loaded from SSD into DRAM.
    ssd_promote_on_hit: bool = True
    #: O_DIRECT (falls back to buffered I/O, with a warning, where a file system rejects it).
    ssd_direct_io: bool = True
    #: When the pool is created, write superblocks over device files or block devices that hold
    #: other data. Without it such a device is refused (the pool takes only new or empty files,
    #: blank block devices and its own devices): a mistyped path never destroys a file.
    ssd_format_devices: bool = False
    #: Codec blocks are encoded with as they are written to SSD: ``"raw"``, ``"lossless"`` (with
    #: ``ssd_codec_backend`` zstd|lz4|deflate, optional ``ssd_codec_level``) or ``"quant"`` (CacheGen's
    #: bins; fp16 geometry without extra groups). Each stored object records its codec, so reads
    #: never depend on this setting. DRAM always holds raw blocks.
    ssd_codec: str = "raw"
    ssd_codec_backend: str | None = None
    ssd_codec_level: int | None = None
    #: The remote tier below DRAM (and SSD): ``redis://[user[:password]@]host[:port][/db]``, or
    #: seed nodes with ``remote_cluster``. Empty: no remote tier. See ``docs/remote.md``.
    remote_urls: tuple[str, ...] = ()
    remote_cluster: bool = False
    remote_username: str | None = None
    remote_password: str | None = field(default=None, repr=False)
    #: Expiry of stored objects, from the write that created them (``None``: none).
    remote_ttl_s: float | None = None
    remote_connect_timeout_s: float = 1.0
    remote_io_timeout_s: float = 5.0
    #: A failed server is not tried again for this long, doubling up to the max; its keys miss.
    remote_reconnect_backoff_min_s: float = 0.05
    remote_reconnect_backoff_max_s: float = 2.0
    #: Value bytes one pipeline may have sent and not had answered.
    remote_inflight_bytes_max: int = 64 * 2**20
    remote_connections_per_node_max: int = 8
    remote_key_prefix: str = "kvtier:"
    #: TLS (with ``rediss://`` URLs): the CA that signed the server certificate (default: the
    #: Mozilla roots built in), a client certificate and key (mutual TLS), the name to verify.
    remote_tls_ca_file: str | None = None
    remote_tls_cert_file: str | None = None
    remote_tls_key_file: str | None = None
    remote_tls_server_name: str | None = None
    #: Write every put to the remote tier (shared at once); false: only what DRAM evicts.
    remote_write_through: bool = True
    #: Copy blocks loaded from the remote tier into DRAM.
    remote_promote_on_hit: bool = True
    #: Codec of blocks written to the remote tier (as ``ssd_codec``).
    remote_codec: str = "raw"
    remote_codec_backend: str | None = None
    remote_codec_level: int | None = None
    namespace: Namespace = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.geometry, Geometry):
            raise ConfigError(f"`geometry` is {type(self.geometry).__name__}; expected kvtier.Geometry")
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ConfigError(f"`model_id` is {shown(self.model_id)}; expected a non-empty string")
        if not isinstance(self.cache_salt, str):
            raise ConfigError(f"`cache_salt` is {shown(self.cache_salt)}; expected a string")
        _namespace_field("model_id", self.model_id)
        _namespace_field("cache_salt", self.cache_salt)
        capacity = parse_size(self.dram_capacity_bytes, "dram_capacity_bytes", DRAM_CAPACITY_BYTES_MAX)
        if capacity < self.geometry.block_bytes:
            raise ConfigError(
                f"`dram_capacity_bytes` is {capacity}; expected at least one block "
                f"({self.geometry.block_bytes} bytes)"
            )
        object.__setattr__(self, "dram_capacity_bytes", capacity)
        if self.eviction not in EVICTION_POLICIES:
            raise ConfigError(
                f"`eviction` is {shown(self.eviction)}; expected one of {list(EVICTION_POLICIES)}"
            )
        _int_in("copy_threads", self.copy_threads, 0, 256)
        _int_in("leases_max", self.leases_max, 1, 2**24)
        _int_in("rank", self.rank, 0, 2**32 - 1)
        _int_in("layout_version", self.layout_version, 0, 2**32 - 1)
        if not isinstance(self.dram_prefault, bool):
            raise ConfigError(f"`dram_prefault` is {shown(self.dram_prefault)}; expected true or false")
        _check_lease_ttl(self.lease_ttl_s)
        if self.metrics_port is not None:
            _int_in("metrics_port", self.metrics_port, 1, 65535)
        if not isinstance(self.metrics_addr, str) or not self.metrics_addr:
            raise ConfigError(f"`metrics_addr` is {shown(self.metrics_addr)}; expected a host address")
        self._check_ssd()
        object.__setattr__(self, "remote_urls", normalize_urls(self.remote_urls))
        object.__setattr__(
            self,
            "remote_inflight_bytes_max",
            parse_size(self.remote_inflight_bytes_max, "remote_inflight_bytes_max"),
        )
        check_remote(self)
        for tier in ("ssd", "remote"):
            _check_codec(self, tier)
        namespace = Namespace(self.model_id, self.geometry, self.cache_salt, self.rank, self.layout_version)
        object.__setattr__(self, "namespace", namespace)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StoreConfig:
        """From a mapping; ``geometry`` may be a mapping or a preset name such as ``"llama-3-8b"``."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"store config must be a mapping; got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - known, key=repr)  # YAML keys may be ints, None, ...
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
        data = read_yaml(path, "store config")
        if isinstance(data, Mapping) and set(data) == {"store"}:
            data = data["store"]
        if not isinstance(data, Mapping):
            raise ConfigError(f"store config {str(path)!r} must hold a mapping; got {type(data).__name__}")
        return cls.from_dict(data)

    def __repr__(self) -> str:
        """The dataclass repr, with passwords in ``remote_urls`` redacted (``remote_password`` is
        left out); :meth:`to_dict` keeps the real URLs."""
        parts = []
        for f in dataclasses.fields(self):
            if f.repr:
                value = getattr(self, f.name)
                if f.name == "remote_urls":
                    value = tuple(redact_url(u) if isinstance(u, str) else u for u in value)
                parts.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(parts)})"

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        out["geometry"] = self.geometry.to_dict()
        out["ssd_devices"] = list(self.ssd_devices)
        out["remote_urls"] = list(self.remote_urls)
        if self.ssd_bandwidth_bytes_per_s is not None:
            out["ssd_bandwidth_bytes_per_s"] = list(self.ssd_bandwidth_bytes_per_s)
        return out

    @property
    def object_bytes(self) -> int:
        """Bytes one block takes in DRAM: payload + 64-byte header, rounded up to whole pages."""
        return -(-(OBJECT_HEADER_BYTES + self.geometry.block_bytes) // PAGE_BYTES) * PAGE_BYTES

    @property
    def ssd_object_bytes(self) -> int:
        """Bytes one block takes on an SSD device: the payload rounded up to whole pages."""
        return max(1, -(-self.geometry.block_bytes // PAGE_BYTES)) * PAGE_BYTES

    def ssd_options(self) -> dict[str, Any] | None:
        """The SSD settings as the extension takes them, or ``None`` without an SSD tier."""
        if self.ssd_directory is None:
            return None
        return {
            "directory": self.ssd_directory,
            "devices": list(self.ssd_devices),
            "capacity_bytes": self.ssd_capacity_bytes,
            "durability": self.ssd_durability,
            "placement": self.ssd_placement,
            "bandwidth_bytes_per_s": None
            if self.ssd_bandwidth_bytes_per_s is None
            else [float(b) for b in self.ssd_bandwidth_bytes_per_s],
            "io_engine": self.ssd_io_engine,
            "io_depth": self.ssd_io_depth,
            "probe_bytes": self.ssd_probe_bytes,
            "direct_io": self.ssd_direct_io,
            "format_devices": self.ssd_format_devices,
            "admission_k": self.ssd_admission_k,
            "write_through": self.ssd_write_through,
            "promote_on_hit": self.ssd_promote_on_hit,
            **self._codec_options("ssd"),
        }

    def remote_options(self) -> dict[str, Any] | None:
        """The remote settings as the extension takes them, or ``None`` without a remote tier."""
        options = remote_options(self)
        if options is not None:
            options.update(self._codec_options("remote"))
        return options

    def _codec_options(self, tier: str) -> dict[str, Any]:
        return {
            "codec": getattr(self, f"{tier}_codec"),
            "codec_backend": getattr(self, f"{tier}_codec_backend"),
            "codec_level": getattr(self, f"{tier}_codec_level"),
        }

    def _check_ssd(self) -> None:
        """Validates (and normalises) the ``ssd_*`` fields."""
        directory = self.ssd_directory
        if directory is not None:
            if isinstance(directory, PurePath):
                directory = str(directory)
            if not isinstance(directory, str) or not directory:
                raise ConfigError(f"`ssd_directory` is {directory!r}; expected a directory path or None")
            object.__setattr__(self, "ssd_directory", directory)
        devices = self.ssd_devices
        if isinstance(devices, str | bytes) or not isinstance(devices, Sequence):
            raise ConfigError(f"`ssd_devices` is {devices!r}; expected a list of device or file paths")
        devices = tuple(str(d) if isinstance(d, PurePath) else d for d in devices)
        for d in devices:
            if not isinstance(d, str) or not d:
                raise ConfigError(f"`ssd_devices` holds {d!r}; expected non-empty paths")
        if len(set(devices)) != len(devices):
            raise ConfigError(
                f"`ssd_devices` lists a device twice ({list(devices)}); expected distinct devices"
            )
        if len(devices) > SSD_DEVICES_MAX:
            raise ConfigError(f"`ssd_devices` has {len(devices)} devices; expected at most {SSD_DEVICES_MAX}")
        object.__setattr__(self, "ssd_devices", devices)
        if devices and directory is None:
            raise ConfigError(
                "`ssd_devices` is set but `ssd_directory` is None; expected a directory for the index log "
                "(or drop ssd_devices)"
            )
        n = max(1, len(devices))
        capacity = parse_size(self.ssd_capacity_bytes, "ssd_capacity_bytes")
        size = self.ssd_object_bytes
        if capacity < n * size:
            raise ConfigError(
                f"`ssd_capacity_bytes` is {capacity}; expected at least one {size}-byte object "
                f"per device ({n} x {size} = {n * size} bytes)"
            )
        object.__setattr__(self, "ssd_capacity_bytes", capacity)
        _choice("ssd_durability", self.ssd_durability, SSD_DURABILITY)
        _choice("ssd_placement", self.ssd_placement, SSD_PLACEMENTS)
        _choice("ssd_io_engine", self.ssd_io_engine, SSD_IO_ENGINES)
        _int_in("ssd_admission_k", self.ssd_admission_k, 1, SSD_ADMISSION_K_MAX)
        _int_in("ssd_io_depth", self.ssd_io_depth, 1, SSD_IO_DEPTH_MAX)
        probe = parse_size(self.ssd_probe_bytes, "ssd_probe_bytes", SSD_PROBE_BYTES_MAX)
        object.__setattr__(self, "ssd_probe_bytes", probe)
        for name in ("ssd_write_through", "ssd_promote_on_hit", "ssd_direct_io", "ssd_format_devices"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"`{name}` is {shown(getattr(self, name))}; expected true or false")
        bandwidths = self.ssd_bandwidth_bytes_per_s
        if bandwidths is not None:
            ok = isinstance(bandwidths, Sequence) and not isinstance(bandwidths, str | bytes)
            values = tuple(bandwidths) if ok else ()
            if not ok or len(values) != n:
                raise ConfigError(
                    f"`ssd_bandwidth_bytes_per_s` is {bandwidths!r}; expected one number of bytes/s per "
                    f"device ({n})"
                )
            for i, b in enumerate(values):
                # Compared exactly (no float conversion of a huge int); the extension takes f64s.
                if isinstance(b, bool) or not isinstance(b, int | float) or not 0 < b <= sys.float_info.max:
                    raise ConfigError(
                        f"`ssd_bandwidth_bytes_per_s[{i}]` is {shown(b)}; expected a positive number of bytes/s"
                    )
            object.__setattr__(self, "ssd_bandwidth_bytes_per_s", values)


#: Codecs a lower tier may encode with, lossless backends, and each backend's levels
#: (crates/kvtier-codec/src/streams.rs).
TIER_CODECS: tuple[str, ...] = ("raw", "lossless", "quant")
CODEC_BACKEND_LEVELS: dict[str, tuple[int, int]] = {"zstd": (-7, 22), "lz4": (0, 0), "deflate": (1, 12)}


def _check_codec(c: StoreConfig, tier: str) -> None:
    """Validates ``<tier>_codec``, ``<tier>_codec_backend`` and ``<tier>_codec_level``."""
    codec = getattr(c, f"{tier}_codec")
    backend = getattr(c, f"{tier}_codec_backend")
    level = getattr(c, f"{tier}_codec_level")
    _choice(f"{tier}_codec", codec, TIER_CODECS)
    if codec != "lossless":
        if backend is not None or level is not None:
            raise ConfigError(
                f"`{tier}_codec_backend`/`{tier}_codec_level` are set but `{tier}_codec` is {codec!r}; "
                f"they apply to 'lossless' only"
            )
    else:
        if backend is None:
            backend = "zstd"
            object.__setattr__(c, f"{tier}_codec_backend", backend)
        _choice(f"{tier}_codec_backend", backend, tuple(CODEC_BACKEND_LEVELS))
        if level is not None:
            lo, hi = CODEC_BACKEND_LEVELS[backend]
            _int_in(f"{tier}_codec_level", level, lo, hi)
    if codec == "quant":
        g = c.geometry
        if g.dtype != "fp16" or g.extra_groups:
            raise ConfigError(
                f"`{tier}_codec` is 'quant', which needs fp16 KV with no extra groups; the geometry is "
                f"{g.dtype} with {len(g.extra_groups)} extra group(s) (use 'lossless' or 'raw')"
            )


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
            f"`lease_ttl_s` is {shown(ttl)}; expected a positive number of seconds (at least 1 ns once "
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


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"`{name}` is {shown(value)}; expected one of {list(choices)}")


def _int_in(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"`{name}` is {shown(value)}; expected an int in [{lo}, {hi}]")
