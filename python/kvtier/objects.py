"""The stored-object byte format (``docs/formats.md``): 64-byte header, then payload.

Tiers below DRAM (SSD, remote) store exactly these bytes. Decoding verifies magic, version,
header checksum, length and payload checksum, and raises :class:`ObjectFormatError` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy.typing as npt

from kvtier import _core

HEADER_BYTES = 64


@dataclass(frozen=True)
class DecodedObject:
    namespace_hash: bytes
    key: int
    codec_id: int
    payload: bytes


def encode_object(namespace_hash: bytes, key: int, payload: bytes | npt.ArrayLike) -> bytes:
    """Header + payload for block ``key`` of the namespace ``namespace_hash`` (raw codec)."""
    return _core.encode_object(namespace_hash, key.to_bytes(16, "little"), payload)


def decode_object(data: bytes | bytearray | memoryview) -> DecodedObject:
    """Verifies and splits an object; raises :class:`kvtier.errors.ObjectFormatError` if corrupt."""
    ns, key, codec, payload = _core.decode_object(data)
    return DecodedObject(bytes(ns), int.from_bytes(key, "little"), codec, bytes(payload))
