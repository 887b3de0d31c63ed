from __future__ import annotations

import contextlib

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvtier import _core
from kvtier.errors import ObjectFormatError
from kvtier.objects import HEADER_BYTES, decode_object, encode_object

NS = bytes(range(16))


def test_round_trip() -> None:
    obj = encode_object(NS, 12345, b"payload bytes")
    assert len(obj) == HEADER_BYTES + 13
    assert obj[:4] == b"KVTO"
    decoded = decode_object(obj)
    assert (decoded.namespace_hash, decoded.key, decoded.codec_id, decoded.payload) == (
        NS,
        12345,
        0,
        b"payload bytes",
    )
    assert int.from_bytes(obj[48:56], "little") == _core.checksum(b"payload bytes")


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda b: b[:10], "header"),
        (lambda b: b"XXXX" + b[4:], "magic"),
        (lambda b: b[:4] + (7).to_bytes(2, "little") + b[6:], "version 7"),
        (lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:], "header corrupt"),
        (lambda b: b[:-1], "payload is"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 0x80]), "payload corrupt"),
    ],
)
def test_corruption_is_a_typed_error(mutate: object, needle: str) -> None:
    obj = encode_object(NS, 1, b"some kv bytes here")
    with pytest.raises(ObjectFormatError, match=needle):
        decode_object(mutate(obj))  # type: ignore[operator]


@given(st.binary(max_size=300))
def test_decode_never_crashes(data: bytes) -> None:
    with contextlib.suppress(ObjectFormatError):
        decode_object(data)


@pytest.mark.parametrize("offset", [0, 1, 16, 33])
def test_payload_checksum_is_the_reference_xxh3_64(offset: int) -> None:
    """kvtier's own XXH3-64 (``kvtier_core::xxh3``) against the C library's, so checksums stored
    on SSD and remote tiers keep their meaning: every length class of the algorithm (short forms,
    129-240, stripes, blocks of 1024, the held-back last stripe), at unaligned addresses."""
    data = np.random.default_rng(offset).integers(0, 256, (2 << 20) + 200, dtype=np.uint8)
    edges = [0, 1, 3, 4, 8, 9, 16, 17, 63, 64, 65, 128, 129, 239, 240, 241, 1023, 1024, 1025]
    for n in [*edges, 4095, 4096, 4097, 65_536 + 17, 2 << 20, (2 << 20) + 63]:
        view = data[offset : offset + n]
        assert _core.checksum(view) == xxhash.xxh3_64_intdigest(view.tobytes()), n
