"""The sections of :class:`kvtier.StoreConfig`: ``dram``, ``ssd`` and ``remote``, as the Rust store
has them (crates/kvtier-store/src/config.rs: ``dram_*`` settings, ``SsdStoreConfig``,
``RemoteStoreConfig``). Each key is declared once with its check (:mod:`kvtier.schema`); the
bounds are the ones the Rust side enforces, checked here first so that a bad value is a
:class:`ConfigError` naming its key path (``ssd.io_depth``) before any Rust code runs.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from kvtier.errors import ConfigError, shown
from kvtier.remote import check_url, redact_url
from kvtier.schema import (
    Section,
    boolean,
    choice,
    integer,
    key,
    optional,
    paths,
    seconds,
    size,
    text,
)

#: Largest DRAM tier: ``DRAM_CAPACITY_BYTES_MAX``, ``isize::MAX`` (what one mapping may span).
DRAM_CAPACITY_BYTES_MAX = sys.maxsize
#: SSD pool bounds (crates/kvtier-pool/src/ssd/config.rs, kvtier-store/src/config.rs).
SSD_DEVICES_MAX = 64
SSD_IO_DEPTH_MAX = 256
SSD_PROBE_BYTES_MAX = 4 * 2**30
SSD_ADMISSION_K_MAX = 2**20
#: Remote client bounds (crates/kvtier-remote/src/config.rs).
REMOTE_URLS_MAX = 64
REMOTE_DURATION_MAX_S = 3600.0
REMOTE_TTL_MAX_S = 10 * 365 * 24 * 3600
REMOTE_CONNECTIONS_PER_NODE_MAX = 256
REMOTE_KEY_PREFIX_BYTES_MAX = 256
#: Codecs a lower tier may encode with, lossless backends, and each backend's levels
#: (crates/kvtier-codec/src/streams.rs).
TIER_CODECS: tuple[str, ...] = ("raw", "lossless", "quant")
CODEC_BACKEND_LEVELS: dict[str, tuple[int, int]] = {"zstd": (-7, 22), "lz4": (0, 0), "deflate": (1, 12)}


@dataclass(frozen=True, kw_only=True)
class DramConfig(Section):
    """The DRAM tier (host memory), always present."""

    PATH: ClassVar[str] = "dram"
    #: Bytes of host memory; each block takes its payload + a 64-byte header in whole 4 KiB pages.
    capacity_bytes: int = key(size(hi=DRAM_CAPACITY_BYTES_MAX), 4 * 2**30)
    #: Fault the whole arena in at construction (the first puts then run at memcpy speed).
    prefault: bool = key(boolean(), False)


@dataclass(frozen=True, kw_only=True)
class _LowerTier(Section):
    """What every tier below DRAM has: the codec blocks are encoded with as they are written to it
    (``"raw"``, ``"lossless"`` with ``codec_backend`` zstd|lz4|deflate and optional
    ``codec_level``, or ``"quant"``: CacheGen's bins, fp16 geometry without extra groups). Each
    stored object records its codec, so reads never depend on this setting."""

    codec: str = key(choice(*TIER_CODECS), "raw")
    codec_backend: str | None = key(optional(choice(*CODEC_BACKEND_LEVELS)), None)
    codec_level: int | None = key(optional(integer(-(2**7), 2**7 - 1)), None)

    def check(self) -> None:
        if self.codec != "lossless":
            if self.codec_backend is not None or self.codec_level is not None:
                p = self.key_path
                raise ConfigError(
                    f"`{p('codec_backend')}`/`{p('codec_level')}` are set but `{p('codec')}` is "
                    f"{self.codec!r}; they apply to 'lossless' only"
                )
            return
        if self.codec_backend is None:
            object.__setattr__(self, "codec_backend", "zstd")
        lo, hi = CODEC_BACKEND_LEVELS[str(self.codec_backend)]
        if self.codec_level is not None:
            integer(lo, hi)(self.codec_level, self.key_path("codec_level"))


def _bandwidths(value: Any, path: str) -> tuple[float, ...] | None:
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ConfigError(f"`{path}` is {shown(value)}; expected one number of bytes/s per device")
    for i, b in enumerate(value):
        # Compared exactly (no float conversion of a huge int); the extension takes f64s.
        if isinstance(b, bool) or not isinstance(b, int | float) or not 0 < b <= sys.float_info.max:
            raise ConfigError(f"`{path}[{i}]` is {shown(b)}; expected a positive number of bytes/s")
    return tuple(value)


@dataclass(frozen=True, kw_only=True)
class SsdConfig(_LowerTier):
    """The SSD tier below DRAM (an SSD pool, ``docs/ssd.md``); absent: DRAM only."""

    PATH: ClassVar[str] = "ssd"
    #: Holds the pool's index log, bandwidth cache and lock (and its one device file when
    #: ``devices`` is empty).
    directory: str = key(text(nonempty=True, what="a directory path"), expected="a directory path")
    #: Device paths (raw block devices, or files created and pre-allocated there).
    devices: tuple[str, ...] = key(paths(SSD_DEVICES_MAX, noun="device or file"), ())
    #: Object space over all devices, split equally (used when the pool is created).
    capacity_bytes: int = key(size(), 8 * 2**30)
    #: When ``put`` returns for SSD writes: ``"none"`` (page cache) or ``"fsync"`` (stable storage).
    durability: str = key(choice("none", "fsync"), "none")
    #: A block is written to SSD only after this many accesses (its put is one, each lease one more).
    admission_k: int = key(integer(1, SSD_ADMISSION_K_MAX), 1)
    #: ``"bandwidth"`` (Unified KV pooling, Algorithm 1) or ``"round_robin"``.
    placement: str = key(choice("bandwidth", "round_robin"), "bandwidth")
    #: Bytes/s per device, instead of the start-up probe.
    bandwidth_bytes_per_s: tuple[float, ...] | None = key(_bandwidths, None)
    io_engine: str = key(choice("auto", "io_uring", "pread"), "auto")
    io_depth: int = key(integer(1, SSD_IO_DEPTH_MAX), 8)
    #: Bytes the bandwidth probe writes and reads per device (0: no probe, equal shares).
    probe_bytes: int = key(size(hi=SSD_PROBE_BYTES_MAX), 64 * 2**20)
    #: Also write blocks to SSD when they are put (default: when DRAM evicts them).
    write_through: bool = key(boolean(), False)
    #: Copy blocks loaded from SSD into DRAM.
    promote_on_hit: bool = key(boolean(), True)
    #: O_DIRECT (falls back to buffered I/O, with a warning, where a file system rejects it).
    direct_io: bool = key(boolean(), True)
    #: When the pool is created, write superblocks over device files or block devices that hold
    #: other data. Without it such a device is refused: a mistyped path never destroys a file.
    format_devices: bool = key(boolean(), False)

    def check(self) -> None:
        super().check()
        n = max(1, len(self.devices))
        if self.bandwidth_bytes_per_s is not None and len(self.bandwidth_bytes_per_s) != n:
            raise ConfigError(
                f"`ssd.bandwidth_bytes_per_s` is {list(self.bandwidth_bytes_per_s)!r}; expected one number "
                f"of bytes/s per device ({n})"
            )


def _urls(value: Any, path: str) -> tuple[str, ...]:
    """One URL or a list of them, each checked by the Rust client's parser (never showing a password)."""
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or isinstance(value, bytes):
        raise ConfigError(
            f"`{path}` is a {type(value).__name__}; expected a URL such as 'redis://127.0.0.1:6379' "
            "or a list of them"
        )
    out = tuple(check_url(u, path) for u in value)
    if not 1 <= len(out) <= REMOTE_URLS_MAX:
        raise ConfigError(f"`{path}` has {len(out)} URLs; expected 1 to {REMOTE_URLS_MAX}")
    return out


def _key_prefix(value: Any, path: str) -> str:
    if (
        not isinstance(value, str)
        or len(value.encode()) > REMOTE_KEY_PREFIX_BYTES_MAX
        or any(ch.isspace() or ch in "{}" or ord(ch) < 32 for ch in value)
    ):
        raise ConfigError(
            f"`{path}` is {shown(value)}; expected at most {REMOTE_KEY_PREFIX_BYTES_MAX} bytes without "
            "whitespace, control characters or braces"
        )
    return value


_DURATION = seconds(0.0, REMOTE_DURATION_MAX_S)
_OPTIONAL_TEXT = optional(text(what="a string or None"))


@dataclass(frozen=True, kw_only=True)
class RemoteConfig(_LowerTier):
    """The remote tier (Redis/Valkey server or cluster) below DRAM and SSD (``docs/remote.md``)."""

    PATH: ClassVar[str] = "remote"
    #: ``redis://[user[:password]@]host[:port][/db]`` (``rediss://``: TLS), or seed nodes with ``cluster``.
    urls: tuple[str, ...] = key(_urls, expected="a URL such as 'redis://127.0.0.1:6379' or a list of them")
    cluster: bool = key(boolean(), False)
    username: str | None = key(_OPTIONAL_TEXT, None)
    password: str | None = key(_OPTIONAL_TEXT, None, repr=False)
    #: Expiry of stored objects, from the write that created them (``None``: none).
    ttl_s: float | None = key(optional(seconds(1.0, REMOTE_TTL_MAX_S, lo_open=False)), None)
    connect_timeout_s: float = key(_DURATION, 1.0)
    io_timeout_s: float = key(_DURATION, 5.0)
    #: A failed server is not tried again for this long, doubling up to the max; its keys miss.
    reconnect_backoff_min_s: float = key(_DURATION, 0.05)
    reconnect_backoff_max_s: float = key(_DURATION, 2.0)
    #: Value bytes one pipeline may have sent and not had answered.
    inflight_bytes_max: int = key(size(lo=1), 64 * 2**20)
    connections_per_node_max: int = key(integer(1, REMOTE_CONNECTIONS_PER_NODE_MAX), 8)
    key_prefix: str = key(_key_prefix, "kvtier:")
    #: TLS (``rediss://``): the CA of the server certificate (default: the Mozilla roots built in),
    #: a client certificate and key (mutual TLS), the name to verify.
    tls_ca_file: str | None = key(_OPTIONAL_TEXT, None)
    tls_cert_file: str | None = key(_OPTIONAL_TEXT, None)
    tls_key_file: str | None = key(_OPTIONAL_TEXT, None)
    tls_server_name: str | None = key(_OPTIONAL_TEXT, None)
    #: Write every put to the remote tier (shared at once); false: only what DRAM evicts.
    write_through: bool = key(boolean(), True)
    #: Copy blocks loaded from the remote tier into DRAM.
    promote_on_hit: bool = key(boolean(), True)

    def __repr__(self) -> str:
        """The dataclass repr with passwords in ``urls`` redacted and ``password`` left out."""
        shown_urls = tuple(redact_url(u) for u in self.urls)
        parts = [f"urls={shown_urls!r}"] + [
            f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr and f.name != "urls"
        ]
        return f"RemoteConfig({', '.join(parts)})"

    def check(self) -> None:
        super().check()
        if not self.cluster and len(self.urls) != 1:
            raise ConfigError(
                f"`remote.urls` has {len(self.urls)} URLs but `remote.cluster` is false; expected one "
                "server URL (or cluster: true with seed nodes)"
            )
        if self.username is not None and self.password is None:
            raise ConfigError(
                "`remote.username` is set without `remote.password`; expected both (AUTH user password)"
            )
        if self.reconnect_backoff_max_s < self.reconnect_backoff_min_s:
            raise ConfigError(
                f"`remote.reconnect_backoff_max_s` ({self.reconnect_backoff_max_s}) is below "
                f"`remote.reconnect_backoff_min_s` ({self.reconnect_backoff_min_s}); expected max >= min"
            )
