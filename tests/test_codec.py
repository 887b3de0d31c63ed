"""kvtier.codec: exact round trips, quant error bound and accounting on real KV, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import codec
from kvtier.bench.codec import GEOMETRY, load_blocks
from kvtier.bench.kv_fixture import CHECKOUT_PATH
from kvtier.errors import KvtierError


@pytest.fixture(scope="module")
def blocks() -> np.ndarray:
    return load_blocks(CHECKOUT_PATH)


@settings(max_examples=40, deadline=None)
@given(data=st.binary(min_size=1, max_size=4096), backend=st.sampled_from(codec.BACKENDS))
def test_lossless_round_trips_random_bytes(data: bytes, backend: str) -> None:
    data = data if len(data) % 2 == 0 else data + b"\x00"
    payload = codec.encode(np.frombuffer(data, dtype=np.uint8), "lossless", backend=backend)
    assert codec.decoded_len(payload, "lossless") == len(data)
    assert codec.decode(payload, "lossless").tobytes() == data


@pytest.mark.parametrize("backend", ["zstd", "lz4", "deflate"])
def test_lossless_round_trips_real_kv_and_compresses(blocks: np.ndarray, backend: str) -> None:
    block = blocks[0]
    payload = codec.encode(block, "lossless", backend=backend)
    if backend == "lz4":  # no entropy coder: planes do not shrink by 1/64, so both are stored
        assert len(payload) <= block.nbytes + 64
    else:
        assert len(payload) < block.nbytes
    assert np.array_equal(codec.decode(payload, "lossless"), block)


def test_raw_is_identity(blocks: np.ndarray) -> None:
    payload = codec.encode(blocks[1], "raw")
    assert payload == blocks[1].tobytes()
    assert np.array_equal(codec.decode(payload, 0), blocks[1])


def test_quant_on_real_kv_is_within_bound_and_accounted(blocks: np.ndarray) -> None:
    payloads = [codec.encode(b, "quant", geometry=GEOMETRY) for b in blocks[:4]]
    decoded = np.stack([codec.decode(p, "quant") for p in payloads])
    ratio = blocks[:4].nbytes / sum(map(len, payloads))
    assert ratio > 2.0
    x = blocks[:4].view(np.float16).astype(np.float32).reshape(-1, GEOMETRY.head_dim)
    y = decoded.view(np.float16).astype(np.float32).reshape(-1, GEOMETRY.head_dim)
    scale = np.abs(x).max(axis=1, keepdims=True)
    # Every element within s (1/(2h) + 2^-10), h = (bins - 1) // 2; CacheGen's coarsest is 16 bins (h = 7).
    assert (np.abs(x - y) <= scale * (1 / 14 + 2**-10)).all()
    report = codec.quant_error(blocks[:4], decoded, GEOMETRY)
    assert len(report["relative_error_per_layer"]["k"]) == GEOMETRY.num_layers
    assert 0 < report["mean_abs_error"] < report["max_abs_error"]
    assert report["relative_error_max"] < 0.3


def test_quant_rejects_nan_and_inf(blocks: np.ndarray) -> None:
    block = blocks[0].copy().view(np.float16)
    block[7] = np.inf
    block[9] = np.nan
    with pytest.raises(codec.NonFiniteError, match="2 NaN/inf"):
        codec.encode(block, "quant", geometry=GEOMETRY)


def test_quant_refuses_more_than_half_before_lossless(blocks: np.ndarray) -> None:
    rule = codec.BinRule(0, 32, 32)
    with pytest.raises(codec.CodecError, match="exceeds half"):
        codec.encode(blocks[0], "quant", geometry=GEOMETRY, key_bins=rule, value_bins=rule)


def test_bad_inputs_raise_codec_errors(blocks: np.ndarray) -> None:
    payload = codec.encode(blocks[0], "quant", geometry=GEOMETRY)
    with pytest.raises(codec.CodecError, match="expected codec 1"):
        codec.decode(payload, "lossless")
    with pytest.raises(codec.CodecError, match=r"truncated|declares"):
        codec.decode(payload[: len(payload) // 2], "quant")
    with pytest.raises(codec.CodecError, match="empty"):
        codec.decode(b"", "quant")
    with pytest.raises(codec.CodecError, match="empty"):
        codec.encode(b"", "lossless")
    with pytest.raises(codec.CodecError, match="unknown codec"):
        codec.decode(payload, 7)
    with pytest.raises(codec.CodecError, match="unknown backend"):
        codec.encode(blocks[0], "lossless", backend="brotli")
    with pytest.raises(codec.CodecError, match="needs geometry"):
        codec.encode(blocks[0], "quant")
    with pytest.raises(KvtierError, match="output buffer"):
        codec.decode(payload, "quant", out=np.empty(10, dtype=np.uint8))
    corrupt = bytearray(payload)
    corrupt[24 + 16 + 2 * GEOMETRY.num_layers] = 9  # stream table: backend code
    with pytest.raises(codec.CodecError, match="unknown lossless backend 9"):
        codec.decode(bytes(corrupt), "quant")


#: Every key ``kvtier bench codec --json --no-agreement`` printed before its result became typed
#: classes (recorded from that version).
BENCH_KEYS = """
block_bytes blocks deflate_decode_gbit_per_s_all_cores deflate_decode_gbit_per_s_per_core
deflate_decode_gbit_per_s_pool_1_thread deflate_encode_gbit_per_s_per_core deflate_lossless_ratio
deflate_quant_ratio fixture lossless_ratio lz4_decode_gbit_per_s_per_core lz4_encode_gbit_per_s_per_core
lz4_lossless_ratio lz4_quant_ratio memcpy_gbit_per_s_per_core none_quant_ratio quant_curve
quant_decode_gbit_per_s_per_core quant_encode_gbit_per_s_per_core quant_ratio threads
zstd_decode_gbit_per_s_per_core zstd_encode_gbit_per_s_per_core zstd_lossless_ratio zstd_quant_ratio
"""


def test_bench_codec_json_keys_are_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvtier import cli

    assert cli.main(["bench", "codec", "--repeats", "1", "--no-agreement", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == set(BENCH_KEYS.split())
    assert (
        out["lossless_ratio"] == out["deflate_lossless_ratio"]
        and out["quant_ratio"] == out["deflate_quant_ratio"]
    )
    for row in out["quant_curve"]:
        keys = {"setting", "refused"} if "refused" in row else {"setting", "ratio", *QUANT_ERROR_KEYS}
        assert set(row) == keys, row


QUANT_ERROR_KEYS = (
    "max_abs_error",
    "mean_abs_error",
    "mean_abs_value",
    "relative_error_per_layer",
    "relative_error_max",
)
