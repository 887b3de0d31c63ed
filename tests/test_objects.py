from __future__ import annotations

import contextlib

import pytest
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
