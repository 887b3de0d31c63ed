from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

import kvtier
from kvtier.errors import KeyHashError
from kvtier.keys import BlockKeys, Namespace

# Golden vectors: fixed hash and seed, so these never change without a namespace version bump.
# The same vectors are checked in Rust (crates/kvtier-core/tests/it/golden_keys.rs).
GOLDEN_GEOMETRY = kvtier.Geometry(32, 8, 128, "bf16", 16)
GOLDEN_NAMESPACE_HEX = "6ffd1453ff86d5d21d739dc2b13648af"
GOLDEN_KEYS_HEX = [
    "c5a1590c4528e869a356a9c21f87a0d1",
    "658200a4d269db61b071065e284625c7",
    "8e9080ff48d1f6ada1dfc49f90cdde3c",
]


def golden_namespace() -> Namespace:
    return Namespace("meta-llama/Llama-3.1-8B", GOLDEN_GEOMETRY, cache_salt="", rank=0, layout_version=1)


def test_golden_vectors() -> None:
    ns = golden_namespace()
    assert int.from_bytes(ns.hash, "little") == int(GOLDEN_NAMESPACE_HEX, 16)
    keys = ns.block_keys(list(range(48)))
    assert keys.hex() == GOLDEN_KEYS_HEX


def test_keys_match_an_independent_xxh3_implementation() -> None:
    """Re-derives the scheme of docs/formats.md §1 with the `xxhash` package (not kvtier's code)."""
    seed = 0x6B76_7469_6572_0001
    u32 = struct.Struct("<I")
    model = b"meta-llama/Llama-3.1-8B"
    ns_input = (
        b"kvtier-ns"
        + u32.pack(1)
        + u32.pack(len(model))
        + model
        + b"geom"
        + b"".join(u32.pack(v) for v in (32, 8, 128, 16))
        + bytes([2])  # bf16
        + u32.pack(0)  # no extra groups
        + u32.pack(1)  # layout version
        + u32.pack(0)  # empty salt
        + u32.pack(0)  # rank
    )
    parent = xxhash.xxh3_128_intdigest(ns_input, seed=seed)
    assert parent == int.from_bytes(golden_namespace().hash, "little")
    expected = []
    for block in range(3):
        data = parent.to_bytes(16, "little") + b"".join(
            u32.pack(t) for t in range(16 * block, 16 * block + 16)
        )
        parent = xxhash.xxh3_128_intdigest(data, seed=seed)
        expected.append(f"{parent:032x}")
    assert golden_namespace().block_keys(range(48)).hex() == expected


def test_only_full_blocks_get_keys() -> None:
    ns = golden_namespace()
    assert len(ns.block_keys(range(15))) == 0
    assert len(ns.block_keys(range(17))) == 1
    assert len(ns.block_keys([])) == 0


def test_prefix_shares_keys_and_divergence_changes_the_rest() -> None:
    ns = golden_namespace()
    a = ns.block_keys(np.arange(64))
    b = ns.block_keys(np.arange(32))
    assert a[:2] == b
    changed = np.arange(64)
    changed[0] = 999
    c = ns.block_keys(changed)
    assert all(x != y for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize(
    "other",
    [
        Namespace("other-model", GOLDEN_GEOMETRY),
        Namespace("meta-llama/Llama-3.1-8B", GOLDEN_GEOMETRY, cache_salt="tenant-b"),
        Namespace("meta-llama/Llama-3.1-8B", GOLDEN_GEOMETRY, rank=1),
        Namespace("meta-llama/Llama-3.1-8B", GOLDEN_GEOMETRY, layout_version=2),
        Namespace("meta-llama/Llama-3.1-8B", kvtier.Geometry(32, 8, 128, "fp16", 16)),
    ],
)
def test_namespaces_never_share_keys(other: Namespace) -> None:
    tokens = np.arange(64)
    ours = set(golden_namespace().block_keys(tokens))
    theirs = set(other.block_keys(tokens))
    assert not ours & theirs


def test_extra_changes_keys() -> None:
    ns = golden_namespace()
    assert ns.block_keys(range(16)) != ns.block_keys(range(16), extra=b"lora-7")


def test_128k_tokens_in_one_call() -> None:
    ns = golden_namespace()
    tokens = np.random.default_rng(0).integers(0, 128_000, 131072)
    keys = ns.block_keys(tokens)
    assert len(keys) == 8192
    assert len(set(keys)) == 8192
    assert keys[:100] == ns.block_keys(tokens[: 100 * 16])


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.sampled_from([1, 3, 16]))
def test_dtype_of_tokens_does_not_matter(tokens: list[int], block_tokens: int) -> None:
    ns = Namespace("m", kvtier.Geometry(1, 1, 1, "fp16", block_tokens))
    as_list = ns.block_keys(tokens)
    as_u32 = ns.block_keys(np.array(tokens, dtype=np.uint32))
    as_i64 = ns.block_keys(np.array(tokens, dtype=np.int64))
    assert as_list == as_u32 == as_i64
    assert len(as_list) == len(tokens) // block_tokens


@pytest.mark.parametrize(
    ("tokens", "needle"),
    [
        ([-1, 2], "out of range"),
        ([2**32], "out of range"),
        ([[1, 2]], "1-D"),
        ([1.5, 2.0], "integer"),
    ],
)
def test_bad_tokens(tokens: object, needle: str) -> None:
    with pytest.raises(KeyHashError, match=needle):
        golden_namespace().block_keys(tokens)  # type: ignore[arg-type]


def test_block_keys_sequence_behaviour() -> None:
    keys = golden_namespace().block_keys(range(64))
    assert isinstance(keys, BlockKeys)
    assert keys[-1] == list(keys)[3]
    with pytest.raises(IndexError):
        keys[4]
    with pytest.raises(KeyHashError, match="step 1"):
        keys[::2]


def test_every_token_input_type_gives_the_same_keys() -> None:
    """Lists, tuples, array.array, memoryviews and numpy arrays of any int dtype are converted in
    Rust (no numpy round trip for lists), all to the same keys."""
    import array

    ns = Namespace("m", kvtier.Geometry(1, 1, 1, "fp16", 4))
    values = [0, 1, 2, 3, 127, 5, 6, 7, 100, 9, 10, 11]
    expected = ns.block_keys(np.array(values, dtype=np.uint32))
    inputs: list[object] = [
        values,
        tuple(values),
        range(0),  # checked separately below
        array.array("I", values),
        array.array("q", values),
        array.array("B", values),
        memoryview(array.array("H", values)),
        np.repeat(np.array(values, dtype=np.int64), 2)[::2],  # a strided view
        np.array([[v, 0] for v in values], dtype=np.int32)[:, 0],  # a strided column
    ]
    inputs += [
        np.array(values, dtype=d)
        for d in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.int64, np.uint64, ">i4", ">u8")
    ]
    for tokens in inputs:
        if isinstance(tokens, range):
            assert len(ns.block_keys(tokens)) == 0
            continue
        assert ns.block_keys(tokens) == expected, type(tokens)  # type: ignore[arg-type]
    assert ns.block_keys([np.int64(v) for v in values]) == expected  # numpy scalars in a list


@pytest.mark.parametrize(
    ("tokens", "needle"),
    [
        ([1, 2, -5], "-5 at index 2"),
        ((7, 2**32), "4294967296 at index 1"),
        ([1, 2**70], "at index 1"),
        (np.array([0, 1, 2**32], dtype=np.int64), "at index 2"),
        (np.array([3, -1], dtype=np.int8), "-1 at index 1"),
        ([1, True], "bool"),
        (np.array([True, False]), "integer"),
        ([1, "2"], "token 1 is str"),
        (b"\x01\x02", "bytes"),
        (np.array([1.0, 2.0]), "integer"),
    ],
)
def test_bad_tokens_are_named_by_index(tokens: object, needle: str) -> None:
    with pytest.raises(KeyHashError, match=needle):
        golden_namespace().block_keys(tokens)  # type: ignore[arg-type]
