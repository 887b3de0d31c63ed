"""KV codecs (``kvtier-codec``): ``raw``, ``lossless`` and ``quant``, on chunks of KV bytes.

``encode`` turns a chunk (a ``BlockFirst`` object or a run of its layers) into a payload whose own
header records the codec and every parameter (docs/formats.md §5); ``decode`` needs only the codec
id that the object header records. ``raw`` and ``lossless`` are exact. ``quant`` (vector-wise
binning, CacheGen's bins by default) errs by at most ``s * (1/(2h) + 2**-10)`` per element, where
``h = (bins - 1) // 2`` and ``s`` is the max |x| of the element's token vector, and rejects NaN/inf with
:class:`NonFiniteError`.

>>> import numpy as np
>>> kv = np.arange(4096, dtype=np.float16)
>>> payload = encode(kv, "lossless", backend="deflate")
>>> bool((decode(payload, "lossless").view(np.float16) == kv).all())
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier import _core
from kvtier.errors import BufferError, KvtierError
from kvtier.geometry import Geometry

CODEC_IDS: dict[str, int] = {"raw": 0, "lossless": 1, "quant": 2}
BACKENDS: tuple[str, ...] = ("none", "zstd", "lz4", "deflate")


class CodecError(KvtierError, ValueError):
    """A chunk cannot be encoded, or a payload is corrupt, truncated or of another codec."""


class NonFiniteError(CodecError):
    """``quant`` was given NaN or inf values; it rejects them rather than emit garbage."""


@dataclass(frozen=True)
class BinRule:
    """``early_bins`` bins for layers below ``early_layers``, then ``late_bins`` (3..=255)."""

    early_layers: int
    early_bins: int
    late_bins: int

    def __post_init__(self) -> None:
        if self.early_layers < 0:
            raise CodecError(f"early_layers is {self.early_layers}; expected >= 0")
        for name in ("early_bins", "late_bins"):
            bins = getattr(self, name)
            if not 3 <= bins <= 255:
                raise CodecError(f"{name} is {bins}; expected 3..255")

    def bins(self, layer: int) -> int:
        return self.early_bins if layer < self.early_layers else self.late_bins


CACHEGEN_KEYS = BinRule(early_layers=10, early_bins=32, late_bins=16)
CACHEGEN_VALUES = BinRule(early_layers=2, early_bins=32, late_bins=16)


def codec_id(codec: str | int) -> int:
    """The id of ``codec`` (a name or an id); raises :class:`CodecError` listing the known ones."""
    if isinstance(codec, int) and codec in CODEC_IDS.values():
        return codec
    if isinstance(codec, str) and codec in CODEC_IDS:
        return CODEC_IDS[codec]
    raise CodecError(
        f"unknown codec {codec!r}; known: {', '.join(f'{n} ({i})' for n, i in CODEC_IDS.items())}"
    )


def _byte_view(data: Any) -> np.ndarray:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    array = np.asarray(data)
    # The same rule as the Rust buffer layer (it sees only the byte view taken below).
    if array.dtype.kind not in "biuf" or not array.dtype.isnative or array.dtype.fields is not None:
        raise BufferError(
            f"data has items of type {array.dtype}; expected plain numbers (uint8, float16, ...)"
        )
    if not array.flags.c_contiguous:
        raise CodecError("data must be C-contiguous")
    return array.reshape(-1).view(np.uint8)


def encode(
    data: Any,
    codec: str | int = "lossless",
    *,
    backend: str = "deflate",
    level: int | None = None,
    geometry: Geometry | None = None,
    first_layer: int = 0,
    key_bins: BinRule = CACHEGEN_KEYS,
    value_bins: BinRule = CACHEGEN_VALUES,
) -> bytes:
    """Payload of ``data`` (any C-contiguous buffer) under ``codec``.

    ``backend`` is the lossless stage (``none``, ``zstd``, ``lz4``, ``deflate``) of ``lossless`` and
    ``quant``; ``level`` defaults to zstd 3, deflate 6. ``quant`` needs an fp16 ``geometry``: the
    chunk is layers ``first_layer..`` of one ``BlockFirst`` object (K and V, no extra groups).
    """
    cid = codec_id(codec)
    if backend not in BACKENDS:
        raise CodecError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    raw = _byte_view(data)
    if raw.nbytes == 0:
        raise CodecError("data is empty; codecs encode at least one byte")
    if cid == CODEC_IDS["raw"]:
        return raw.tobytes()
    if cid == CODEC_IDS["lossless"]:
        return _core.codec_encode_lossless(raw, backend, level)
    if geometry is None:
        raise CodecError("quant needs geometry= (the chunk's layers, heads, head_dim, block_tokens)")
    if geometry.dtype != "fp16":
        raise CodecError(f"quant encodes fp16 KV; geometry dtype is {geometry.dtype}")
    layer_bytes = 2 * geometry.segment_bytes
    if raw.nbytes % layer_bytes:
        raise CodecError(
            f"data has {raw.nbytes} bytes; expected a multiple of {layer_bytes} (one layer's K and V)"
        )
    layers = range(first_layer, first_layer + raw.nbytes // layer_bytes)
    if layers.stop > geometry.num_layers:
        raise CodecError(
            f"layers {layers.start}..{layers.stop - 1} exceed the geometry's {geometry.num_layers}"
        )
    return _core.codec_encode_quant(
        raw,
        first_layer,
        geometry.block_tokens,
        geometry.num_kv_heads,
        geometry.head_dim,
        [key_bins.bins(layer) for layer in layers],
        [value_bins.bins(layer) for layer in layers],
        backend,
        level,
    )


def decoded_len(payload: Any, codec: str | int) -> int:
    """Bytes ``payload`` decodes to, from its header alone."""
    return int(_core.codec_decoded_len(codec_id(codec), _byte_view(payload)))


def decode(payload: Any, codec: str | int, out: Any = None) -> np.ndarray:
    """Decodes ``payload`` of ``codec`` (the object header's codec id) into ``out`` (a writable
    buffer, allocated when ``None``); returns the decoded bytes as a uint8 array (a view of ``out``).
    Raises :class:`CodecError` on corrupt, truncated or mismatched payloads."""
    cid = codec_id(codec)
    src = _byte_view(payload)
    needed = int(_core.codec_decoded_len(cid, src))
    target = np.empty(needed, dtype=np.uint8) if out is None else _byte_view(out)
    written = int(_core.codec_decode(cid, src, target))
    return target[:written]


def quant_error(original: Any, decoded: Any, geometry: Geometry) -> dict[str, Any]:
    """Error of a ``quant`` round trip of whole ``BlockFirst`` fp16 objects: max and mean absolute
    error, and relative error ``|x - y|_2 / |x|_2`` per layer for K and V."""
    shape = (-1, geometry.num_layers, 2, geometry.block_tokens * geometry.num_kv_heads * geometry.head_dim)
    x = np.asarray(original).reshape(-1).view(np.float16).astype(np.float32).reshape(shape)
    y = np.asarray(decoded).reshape(-1).view(np.float16).astype(np.float32).reshape(shape)
    diff = np.abs(x - y)
    norm = np.sqrt((x**2).sum(axis=(0, 3)))
    rel = np.sqrt((diff**2).sum(axis=(0, 3))) / np.maximum(norm, np.finfo(np.float32).tiny)
    return {
        "max_abs_error": float(diff.max()),
        "mean_abs_error": float(diff.mean()),
        "mean_abs_value": float(np.abs(x).mean()),
        "relative_error_per_layer": {"k": [float(v) for v in rel[:, 0]], "v": [float(v) for v in rel[:, 1]]},
        "relative_error_max": float(rel.max()),
    }
