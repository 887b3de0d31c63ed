"""Hardening (issue 15, defect 10): a codec payload's header is untrusted. A decoded length no
KV block can have (2^40, 2^64 - 1) is a :class:`kvtier.errors.KvtierError` naming it, raised
before anything is allocated for it: not a MemoryError, not a bare ValueError.

Issue 15 review: a small payload whose header declares up to the largest allowed length
(``DECODED_LEN_MAX``, 1 GiB) must not make the decoder fill that much memory before it finds the
payload corrupt, nor keep it afterwards; a seeded fuzz of mutated payloads and objects; and the
numbers these functions take (codec ids, levels, layers, bins, block keys) are checked in
Python: a bool is not a number, and one out of range is named, not a bare OverflowError."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from kvtier import codec, objects
from kvtier.errors import KeyHashError, KvtierError, ObjectFormatError
from kvtier.geometry import Geometry


@pytest.mark.parametrize("claim", [2**40, 2**64 - 1, 2**30 + 1])
@pytest.mark.parametrize("name", ["lossless"])
def test_defect10_a_header_claiming_an_absurd_length_is_refused(name: str, claim: int) -> None:
    block = np.arange(4096, dtype=np.uint16).view(np.uint8)
    payload = bytearray(codec.encode(block, name))
    payload[8:16] = claim.to_bytes(8, "little")
    for call in (lambda: codec.decoded_len(payload, name), lambda: codec.decode(payload, name)):
        with pytest.raises(KvtierError, match="decoded length") as info:
            call()
        assert not isinstance(info.value, MemoryError)
        assert str(claim) in str(info.value)


#: Run in a child: its memory is this test's alone. Prints the KiB still resident after a real
#: 160 MiB encode and decode beyond what the process held before them, then the KiB its peak grew
#: by decoding 16 KiB payloads that each declare 1 GiB.
_MEMORY_CHILD = """
import resource, numpy as np
from kvtier import codec
from kvtier.errors import KvtierError

def resident_kib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024

block = np.arange(8192, dtype=np.uint16).view(np.uint8)
start = resident_kib()
zeros = codec.encode(np.zeros(160 << 20, np.uint8), "lossless", backend="zstd")
assert len(codec.decode(zeros, "lossless")) == 160 << 20
print(resident_kib() - start)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for backend in ("none", "zstd", "lz4", "deflate"):
    payload = bytearray(codec.encode(block, "lossless", backend=backend))
    payload[8:16] = (1 << 30).to_bytes(8, "little")
    try:
        codec.decode(bytes(payload), "lossless")
    except KvtierError:
        pass
    else:
        raise SystemExit("a payload declaring 1 GiB was decoded")
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_a_payload_declaring_a_huge_length_neither_fills_nor_keeps_memory() -> None:
    """The codecs' per-thread scratch grew to the declared length, zero-filled (1 GiB resident for
    a 16 KiB payload, before its streams were found not to add up), and was kept for the thread's
    life; after a real encode or decode of a large block too."""
    child = subprocess.run([sys.executable, "-c", _MEMORY_CHILD], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    kept_kib, peak_kib = (int(line) for line in child.stdout.split())
    assert kept_kib < 64 * 1024, f"{kept_kib} KiB stayed resident after the codec calls returned"
    assert peak_kib < 64 * 1024, f"decoding refused payloads grew the peak by {peak_kib} KiB"


GEOMETRY = Geometry(4, 2, 64, "fp16", 16)
BINS = codec.BinRule(early_layers=0, early_bins=16, late_bins=16)


def _mutated(rng: np.random.Generator, data: bytes) -> bytes:
    """``data`` with bits flipped, bytes set, a cut, an extension, or a length-sized field set
    to an extreme value (the header fields sit in the first 64 bytes)."""
    b = bytearray(data)
    kind = int(rng.integers(0, 5))
    if kind == 0:
        for i in rng.integers(0, len(b), int(rng.integers(1, 4))):
            b[i] ^= 1 << int(rng.integers(0, 8))
    elif kind == 1:
        b[int(rng.integers(0, len(b)))] = int(rng.integers(0, 256))
    elif kind == 2:
        del b[int(rng.integers(0, len(b))) :]
    elif kind == 3:
        b += rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
    else:
        at = int(rng.integers(0, min(len(b) - 8, 64)))
        value = [0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1][int(rng.integers(0, 6))]
        b[at : at + 8] = value.to_bytes(8, "little")
    return bytes(b)


def test_mutated_payloads_and_objects_are_refused_or_bounded_never_a_crash() -> None:
    """A seeded fuzz (a few thousand cases, about a second): every mutated codec payload either
    decodes to the length its header declares or raises a :class:`CodecError`; every mutated
    object either raises :class:`ObjectFormatError` or is the original, byte for byte (its
    checksums cover every byte). Codec payloads carry no checksum of their own: the object
    header's covers them, so a payload that still parses may decode to other values."""
    rng = np.random.default_rng(15)
    kv = rng.uniform(-2, 2, GEOMETRY.block_bytes // 2).astype(np.float16).view(np.uint8)
    payloads = [(codec.encode(kv, "raw"), "raw"), (codec.encode(kv[:-1], "lossless"), "lossless")]
    payloads += [(codec.encode(kv, "lossless", backend=b), "lossless") for b in codec.BACKENDS]
    payloads += [
        (codec.encode(kv, "quant", backend=b, geometry=GEOMETRY, key_bins=BINS, value_bins=BINS), "quant")
        for b in ("none", "zstd")
    ]
    outcomes = {"decoded": 0, "refused": 0}
    for i in range(3000):
        payload, name = payloads[i % len(payloads)]
        bad = _mutated(rng, payload)
        try:
            out = codec.decode(bad, name)
        except codec.CodecError:
            outcomes["refused"] += 1
            continue
        assert len(out) == codec.decoded_len(bad, name) <= 2**30
        outcomes["decoded"] += 1
    assert outcomes["refused"] > 1000, outcomes

    namespace, key = bytes(range(16)), 0x0123_4567_89AB_CDEF_0011_2233_4455_6677
    obj = objects.encode_object(namespace, key, kv.tobytes())
    refused = 0
    for _ in range(3000):
        bad = _mutated(rng, obj)
        try:
            decoded = objects.decode_object(bad)
        except ObjectFormatError:
            refused += 1
            continue
        assert bad == obj, "a changed object was accepted"
        assert (decoded.namespace_hash, decoded.key, decoded.payload) == (namespace, key, kv.tobytes())
    assert refused > 2900


@pytest.mark.parametrize("bad", [True, -1, 2**128, 1.0, "1"], ids=repr)
def test_a_block_key_is_an_int_in_range(bad: object) -> None:
    """``encode_object`` took ``key.to_bytes``: -1 and 2**128 raised OverflowError, a numpy int an
    AttributeError, and True became key 1."""
    with pytest.raises(
        KeyHashError, match=rf"key {re.escape(repr(bad))} .*expected an int in \[0, 2\*\*128\)"
    ):
        objects.encode_object(bytes(16), bad, b"kv")  # type: ignore[arg-type]
    assert objects.decode_object(objects.encode_object(bytes(16), np.uint64(7), b"kv")).key == 7


def test_codec_numbers_are_ints_in_range() -> None:
    """A bool was codec 1 (``lossless``), level 1 or layer 1; a level or first layer out of the
    binding's int type was a bare OverflowError; BinRule took floats and bools as bin counts."""
    block = np.zeros(2 * GEOMETRY.segment_bytes, np.uint8)
    payload = codec.encode(block, "lossless")
    with pytest.raises(codec.CodecError, match="unknown codec True"):
        codec.decode(payload, True)  # type: ignore[arg-type]
    for level in (True, 1000, -1000, 2.0):
        with pytest.raises(codec.CodecError, match=rf"level {level!r} .*expected an int in \[-128, 127\]"):
            codec.encode(block, "lossless", backend="zstd", level=level)  # type: ignore[arg-type]
    for first in (True, -1, 2**16, 1.0):
        with pytest.raises(
            codec.CodecError, match=rf"first_layer {first!r} .*expected an int in \[0, 65535\]"
        ):
            codec.encode(block, "quant", geometry=GEOMETRY, first_layer=first, key_bins=BINS, value_bins=BINS)  # type: ignore[arg-type]
    for args in [(True, 16, 16), (0, 16.5, 16), (0, 16, True), ("a", 16, 16)]:
        with pytest.raises(codec.CodecError, match=r"expected an int"):
            codec.BinRule(*args)  # type: ignore[arg-type]
