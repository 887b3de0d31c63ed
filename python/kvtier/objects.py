"""The stored-object byte format (``docs/formats.md``): 64-byte header, then payload.

Tiers below DRAM (SSD, remote) store exactly these bytes. Decoding verifies magic, version,
header checksum, length and payload checksum, and raises :class:`ObjectFormatError` otherwise.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvtier import _core
from kvtier.errors import KeyHashError

HEADER_BYTES = 64


@dataclass(frozen=True)
class DecodedObject:
    namespace_hash: bytes
    key: int
    codec_id: int
    payload: bytes


def encode_object(namespace_hash: bytes, key: int, payload: bytes | npt.ArrayLike) -> bytes:
    """Header + payload for block ``key`` of the namespace ``namespace_hash`` (raw codec)."""
    try:  # a bool is not a key (True would be key 1)
        k = None if isinstance(key, bool | np.bool_) else operator.index(key)
    except TypeError:
        k = None
    if k is None or not 0 <= k < 2**128:
        raise KeyHashError(f"key {key!r} is out of range or not an int; expected an int in [0, 2**128)")
    return _core.encode_object(namespace_hash, k.to_bytes(16, "little"), payload)


def decode_object(data: bytes | bytearray | memoryview) -> DecodedObject:
    """Verifies and splits an object; raises :class:`kvtier.errors.ObjectFormatError` if corrupt."""
    ns, key, codec, payload = _core.decode_object(data)
    return DecodedObject(bytes(ns), int.from_bytes(key, "little"), codec, bytes(payload))
