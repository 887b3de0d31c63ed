"""The remote tier (Redis/Valkey server or Redis Cluster): URL checks for the ``remote`` section of
:class:`kvtier.StoreConfig` (:class:`kvtier.config_sections.RemoteConfig`), and :class:`RemotePool`,
the tier on its own.

Blocks are stored as kvtier objects (64-byte header + payload, ``docs/formats.md``) under
``<remote.key_prefix><namespace hex>:<block key hex>``; nothing read from the server is ever
unpickled or evaluated, and every value is checked (length, header, namespace, key, checksum)
before it counts as loaded. A server that is down gives counted misses, never an exception;
a wrong URL or password is a :class:`~kvtier.errors.ConfigError` when the store opens.

Throw-away loopback servers for tests and benchmarks are in :mod:`kvtier.testing.redis`. See
``docs/remote.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvtier import _core
from kvtier.errors import ConfigError
from kvtier.schema import Section


def redact_url(url: str) -> str:
    """``url`` with the password of its user information replaced by ``***``, for messages and
    reprs: ``redis://alice:***@host:6379/0``, ``redis://:***@host`` (the Rust client's rule, the
    one every message uses)."""
    return str(_core.redact_url(url))


def check_url(url: object, name: str = "remote.urls") -> str:
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


class RemotePool:
    """The remote tier alone, for one namespace: put/get/exists of verified kvtier objects, plus
    ``raw_set``/``raw_get`` of plain values (the raw-client baseline of ``kvtier bench remote``,
    and a way to plant test values). ``config`` is a :class:`kvtier.RemoteConfig` (a store config's
    ``remote`` section) or a mapping of its client keys (``urls``, ``cluster``, timeouts, TLS...: not
    the store's codec, ``write_through`` or ``promote_on_hit``); another key is a ConfigError."""

    def __init__(self, config: Section | Mapping[str, Any], namespace_hash: bytes) -> None:
        self._core = _core.RemotePool(config, namespace_hash)

    def key_name(self, key: int) -> bytes:
        return bytes(self._core.key_name(key.to_bytes(16, "little")))

    def put(
        self, keys_raw: bytes, objects: np.ndarray | list[np.ndarray], block_bytes: int
    ) -> tuple[int, int, int]:
        """Stores blocks; returns (stored, already_present, rejected)."""
        stored, present, rejected = self._core.put(keys_raw, objects, block_bytes)
        return int(stored), int(present), int(rejected)

    def get(self, keys_raw: bytes, out: np.ndarray | list[np.ndarray], block_bytes: int) -> list[str]:
        """Loads and verifies blocks; one of ``loaded``/``corrupt``/``missing`` per key, or
        ``wrong_length`` for a value that is not one object of ``block_bytes`` (another codec's
        object, or ``block_bytes`` is not the stored size): left on the server, not counted."""
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

    def metrics(self) -> _core.RemoteMetrics:
        return self._core.metrics()
