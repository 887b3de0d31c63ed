"""The remote tier (Redis/Valkey server or Redis Cluster): settings checks for
:class:`kvtier.StoreConfig`'s ``remote_*`` fields, and :class:`RemotePool`, the tier on its own.

Blocks are stored as kvtier objects (64-byte header + payload, ``docs/formats.md``) under
``<remote_key_prefix><namespace hex>:<block key hex>``; nothing read from the server is ever
unpickled or evaluated, and every value is checked (length, header, namespace, key, checksum)
before it counts as loaded. A server that is down gives counted misses, never an exception;
a wrong URL or password is a :class:`~kvtier.errors.ConfigError` when the store opens.

Throw-away loopback servers for tests and benchmarks are in :mod:`kvtier.testing.redis`. See
``docs/remote.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from kvtier import _core
from kvtier.errors import ConfigError, shown

#: Bounds the Rust client enforces (crates/kvtier-remote/src/config.rs).
REMOTE_URLS_MAX = 64
REMOTE_DURATION_MAX_S = 3600.0
REMOTE_TTL_MAX_S = 10 * 365 * 24 * 3600
REMOTE_CONNECTIONS_PER_NODE_MAX = 256
REMOTE_KEY_PREFIX_BYTES_MAX = 256


class _RemoteFields(Protocol):
    """The ``remote_*`` fields of :class:`kvtier.StoreConfig` (read-only)."""

    @property
    def remote_urls(self) -> tuple[str, ...]: ...

    @property
    def remote_cluster(self) -> bool: ...

    @property
    def remote_username(self) -> str | None: ...

    @property
    def remote_password(self) -> str | None: ...

    @property
    def remote_ttl_s(self) -> float | None: ...

    @property
    def remote_connect_timeout_s(self) -> float: ...

    @property
    def remote_io_timeout_s(self) -> float: ...

    @property
    def remote_reconnect_backoff_min_s(self) -> float: ...

    @property
    def remote_reconnect_backoff_max_s(self) -> float: ...

    @property
    def remote_inflight_bytes_max(self) -> int: ...

    @property
    def remote_connections_per_node_max(self) -> int: ...

    @property
    def remote_key_prefix(self) -> str: ...

    @property
    def remote_tls_ca_file(self) -> str | None: ...

    @property
    def remote_tls_cert_file(self) -> str | None: ...

    @property
    def remote_tls_key_file(self) -> str | None: ...

    @property
    def remote_tls_server_name(self) -> str | None: ...

    @property
    def remote_write_through(self) -> bool: ...

    @property
    def remote_promote_on_hit(self) -> bool: ...


def _seconds(name: str, value: object, lo: float, hi: float, lo_open: bool = True) -> float:
    # Compared exactly, before any float conversion (a huge int would overflow it); NaN fails.
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and (lo < value if lo_open else lo <= value)
        and value <= hi
    )
    if not ok:
        raise ConfigError(
            f"`{name}` is {shown(value)}; expected seconds in {'(' if lo_open else '['}{lo}, {hi}]"
        )
    return float(value)  # type: ignore[arg-type]


def redact_url(url: str) -> str:
    """``url`` with the password of its user information replaced by ``***``, for messages and
    reprs: ``redis://alice:***@host:6379/0``, ``redis://:***@host`` (the Rust client's rule, the
    one every message uses)."""
    return str(_core.redact_url(url))


def check_url(url: object, name: str = "remote_urls") -> str:
    """``url`` if the Rust client parses it (scheme, user, host name or IP address, port
    1-65535, database number); else a :class:`ConfigError` naming ``name`` whose message shows
    the URL with its password redacted."""
    if not isinstance(url, str):
        raise ConfigError(
            f"`{name}` holds a {type(url).__name__}; expected a URL string, "
            "redis://[user[:password]@]host[:port][/db] (or rediss://)"
        )
    try:
        _core.check_url(url)
    except ConfigError as e:
        raise ConfigError(f"`{name}`: {e}") from None
    return url


def normalize_urls(urls: object) -> tuple[str, ...]:
    """``remote_urls`` as a tuple (a single string is one URL), each checked by :func:`check_url`;
    raises :class:`ConfigError` (never showing a password)."""
    if isinstance(urls, str):
        urls = (urls,)
    if not isinstance(urls, Sequence) or isinstance(urls, bytes):
        raise ConfigError(
            f"`remote_urls` is a {type(urls).__name__}; expected a URL such as 'redis://127.0.0.1:6379' "
            "or a list of them"
        )
    out = tuple(check_url(u) for u in urls)
    if len(out) > REMOTE_URLS_MAX:
        raise ConfigError(f"`remote_urls` has {len(out)} URLs; expected at most {REMOTE_URLS_MAX}")
    return out


def check_remote(c: _RemoteFields) -> None:
    """Validates the ``remote_*`` fields of a config (the Rust client checks them again)."""
    if not c.remote_urls:
        return
    if not c.remote_cluster and len(c.remote_urls) != 1:
        raise ConfigError(
            f"`remote_urls` has {len(c.remote_urls)} URLs but `remote_cluster` is false; expected one "
            "server URL (or remote_cluster: true with seed nodes)"
        )
    for name in ("remote_cluster", "remote_write_through", "remote_promote_on_hit"):
        if not isinstance(getattr(c, name), bool):
            raise ConfigError(f"`{name}` is {shown(getattr(c, name))}; expected true or false")
    for name in (
        "remote_username",
        "remote_password",
        "remote_tls_ca_file",
        "remote_tls_cert_file",
        "remote_tls_key_file",
        "remote_tls_server_name",
    ):
        v = getattr(c, name)
        if v is not None and not isinstance(v, str):
            raise ConfigError(f"`{name}` is a {type(v).__name__}; expected a string or None")
    if c.remote_username is not None and c.remote_password is None:
        raise ConfigError(
            "`remote_username` is set without `remote_password`; expected both (AUTH user password)"
        )
    if c.remote_ttl_s is not None:
        _seconds("remote_ttl_s", c.remote_ttl_s, 1.0, REMOTE_TTL_MAX_S, lo_open=False)
    for name in (
        "remote_connect_timeout_s",
        "remote_io_timeout_s",
        "remote_reconnect_backoff_min_s",
        "remote_reconnect_backoff_max_s",
    ):
        _seconds(name, getattr(c, name), 0.0, REMOTE_DURATION_MAX_S)
    if c.remote_reconnect_backoff_max_s < c.remote_reconnect_backoff_min_s:
        raise ConfigError(
            f"`remote_reconnect_backoff_max_s` ({c.remote_reconnect_backoff_max_s}) is below "
            f"`remote_reconnect_backoff_min_s` ({c.remote_reconnect_backoff_min_s}); expected max >= min"
        )
    v = c.remote_inflight_bytes_max
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 2**64 - 1:
        raise ConfigError(
            f"`remote_inflight_bytes_max` is {shown(v)}; expected a positive number of bytes, at most 2**64 - 1"
        )
    v = c.remote_connections_per_node_max
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= REMOTE_CONNECTIONS_PER_NODE_MAX:
        raise ConfigError(
            f"`remote_connections_per_node_max` is {shown(v)}; expected an int in [1, {REMOTE_CONNECTIONS_PER_NODE_MAX}]"
        )
    p = c.remote_key_prefix
    if (
        not isinstance(p, str)
        or len(p.encode()) > REMOTE_KEY_PREFIX_BYTES_MAX
        or any(ch.isspace() or ch in "{}" or ord(ch) < 32 for ch in p)
    ):
        raise ConfigError(
            f"`remote_key_prefix` is {shown(p)}; expected at most {REMOTE_KEY_PREFIX_BYTES_MAX} bytes without "
            "whitespace, control characters or braces"
        )


def remote_options(c: _RemoteFields) -> dict[str, Any] | None:
    """The remote settings as the extension takes them, or ``None`` without a remote tier."""
    if not c.remote_urls:
        return None
    return {
        "urls": list(c.remote_urls),
        "cluster": c.remote_cluster,
        "username": c.remote_username,
        "password": c.remote_password,
        "ttl_s": None if c.remote_ttl_s is None else float(c.remote_ttl_s),
        "connect_timeout_s": float(c.remote_connect_timeout_s),
        "io_timeout_s": float(c.remote_io_timeout_s),
        "reconnect_backoff_min_s": float(c.remote_reconnect_backoff_min_s),
        "reconnect_backoff_max_s": float(c.remote_reconnect_backoff_max_s),
        "inflight_bytes_max": c.remote_inflight_bytes_max,
        "connections_per_node_max": c.remote_connections_per_node_max,
        "key_prefix": c.remote_key_prefix,
        "tls": _tls_options(c),
        "write_through": c.remote_write_through,
        "promote_on_hit": c.remote_promote_on_hit,
    }


def _tls_options(c: _RemoteFields) -> dict[str, str | None] | None:
    """TLS settings for the extension: given when any is set or the URLs are ``rediss://``."""
    tls = {
        "ca_file": c.remote_tls_ca_file,
        "cert_file": c.remote_tls_cert_file,
        "key_file": c.remote_tls_key_file,
        "server_name": c.remote_tls_server_name,
    }
    if all(v is None for v in tls.values()):
        return None
    return tls


class RemotePool:
    """The remote tier alone, for one namespace: put/get/exists of verified kvtier objects, plus
    ``raw_set``/``raw_get`` of plain values (the raw-client baseline of ``kvtier bench remote``,
    and a way to plant test values). ``options`` as :func:`remote_options` returns them."""

    def __init__(self, options: dict[str, Any], namespace_hash: bytes) -> None:
        self._core = _core.RemotePool(options, namespace_hash)

    def key_name(self, key: int) -> bytes:
        return bytes(self._core.key_name(key.to_bytes(16, "little")))

    def put(
        self, keys_raw: bytes, objects: np.ndarray | list[np.ndarray], block_bytes: int
    ) -> tuple[int, int, int]:
        """Stores blocks; returns (stored, already_present, rejected)."""
        stored, present, rejected = self._core.put(keys_raw, objects, block_bytes)
        return int(stored), int(present), int(rejected)

    def get(self, keys_raw: bytes, out: np.ndarray | list[np.ndarray], block_bytes: int) -> list[str]:
        """Loads and verifies blocks; one of ``loaded``/``corrupt``/``missing`` per key."""
        return list(self._core.get(keys_raw, out, block_bytes))

    def exists(self, keys_raw: bytes) -> list[bool | None]:
        return list(self._core.exists(keys_raw))

    def remove(self, keys_raw: bytes) -> int:
        return int(self._core.remove(keys_raw))

    def raw_set(
        self, names: list[bytes], values: np.ndarray | list[np.ndarray], value_bytes: int
    ) -> list[str]:
        return list(self._core.raw_set(names, values, value_bytes))

    def raw_get(self, names: list[bytes], out: np.ndarray | list[np.ndarray], value_bytes: int) -> list[str]:
        return list(self._core.raw_get(names, out, value_bytes))

    def raw_del(self, names: list[bytes]) -> int:
        return int(self._core.raw_del(names))

    def metrics(self) -> dict[str, Any]:
        return dict(self._core.metrics())
