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

import operator
from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np

from kvtier import _core
from kvtier.errors import KvtierError
from kvtier.geometry import Geometry
from kvtier.layout import buffer_array

CODEC_IDS: dict[str, int] = {"raw": 0, "lossless": 1, "quant": 2}
BACKENDS: tuple[str, ...] = ("none", "zstd", "lz4", "deflate")


class CodecError(KvtierError, ValueError):
    """A chunk cannot be encoded, or a payload is corrupt, truncated or of another codec."""


class NonFiniteError(CodecError):
    """``quant`` was given NaN or inf values; it rejects them rather than emit garbage."""


def _int_in(value: object, what: str, lo: int, hi: int) -> int:
    """``value`` as an int in ``[lo, hi]``, checked before it becomes a Rust int: a bool is not
    one (True would be 1), and one out of range is named (pyo3 raises a bare OverflowError)."""
    try:
        n = None if isinstance(value, bool | np.bool_) else operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        n = None
    if n is None or not lo <= n <= hi:
        raise CodecError(f"{what} {value!r} is out of range or not an int; expected an int in [{lo}, {hi}]")
    return n


@dataclass(frozen=True)
class BinRule:
    """``early_bins`` bins for layers below ``early_layers``, then ``late_bins`` (3..=255)."""

    early_layers: int
    early_bins: int
    late_bins: int

    def __post_init__(self) -> None:
        _int_in(self.early_layers, "early_layers", 0, 2**16 - 1)
        for name in ("early_bins", "late_bins"):
            _int_in(getattr(self, name), name, 3, 255)

    def bins(self, layer: int) -> int:
        return self.early_bins if layer < self.early_layers else self.late_bins


CACHEGEN_KEYS = BinRule(early_layers=10, early_bins=32, late_bins=16)
CACHEGEN_VALUES = BinRule(early_layers=2, early_bins=32, late_bins=16)


def codec_id(codec: str | int) -> int:
    """The id of ``codec`` (a name or an id); raises :class:`CodecError` listing the known ones."""
    if isinstance(codec, int) and not isinstance(codec, bool) and codec in CODEC_IDS.values():
        return codec
    if isinstance(codec, str) and codec in CODEC_IDS:
        return CODEC_IDS[codec]
    raise CodecError(
        f"unknown codec {codec!r}; known: {', '.join(f'{n} ({i})' for n, i in CODEC_IDS.items())}"
    )


def _byte_view(data: Any, what: str, *, writable: bool = False) -> np.ndarray:
    """The bytes of ``data`` as a flat uint8 array over the same memory, after the checks every
    buffer crossing into Rust gets (:func:`kvtier.layout.buffer_array`: plain-number items,
    C-contiguous, writable if ``writable``); anything that is not a buffer is refused."""
    arr = buffer_array(data, what, writable=writable)
    return arr.reshape(-1).view(np.uint8)  # C-contiguous: views, never copies


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
    """Payload of ``data`` (any C-contiguous buffer of plain numbers) under ``codec``.

    ``backend`` is the lossless stage (``none``, ``zstd``, ``lz4``, ``deflate``) of ``lossless`` (on
    16-bit byte planes; one plane for an odd number of bytes) and ``quant``; ``level`` defaults to
    zstd 3, deflate 6. ``quant`` needs an fp16 ``geometry``: the chunk is layers ``first_layer..``
    of one ``BlockFirst`` object (K and V, no extra groups).
    """
    cid = codec_id(codec)
    if backend not in BACKENDS:
        raise CodecError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    if level is not None:
        level = _int_in(level, "level", -128, 127)
    raw = _byte_view(data, "data")
    if raw.nbytes == 0:
        raise CodecError("data is empty; codecs encode at least one byte")
    if cid == CODEC_IDS["raw"]:
        return raw.tobytes()
    if cid == CODEC_IDS["lossless"]:
        # 16-bit byte planes (fp16/bf16 KV); an odd number of bytes has no 16-bit elements, so it
        # is one plane. The payload records which (docs/formats.md §5.2): decode needs nothing.
        element_bytes = 2 if raw.nbytes % 2 == 0 else 1
        return _core.codec_encode_lossless(raw, backend, level, element_bytes)
    if geometry is None:
        raise CodecError("quant needs geometry= (the chunk's layers, heads, head_dim, block_tokens)")
    if geometry.dtype != "fp16":
        raise CodecError(f"quant encodes fp16 KV; geometry dtype is {geometry.dtype}")
    items = buffer_array(data, "data").dtype
    # Checked before the bytes are viewed as uint8: a float32 array of a layer's fp16 byte count
    # would be quantized as twice as many (meaningless) fp16 values.
    if items != np.float16 and (items.kind not in "ui" or items.itemsize > 2):
        raise CodecError(
            f"data has dtype {items}; quant encodes fp16 KV: expected float16 (or its raw bytes as uint8/uint16)"
        )
    first_layer = _int_in(first_layer, "first_layer", 0, 2**16 - 1)
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
    return int(_core.codec_decoded_len(codec_id(codec), _byte_view(payload, "payload")))


def decode(payload: Any, codec: str | int, out: Any = None) -> np.ndarray:
    """Decodes ``payload`` of ``codec`` (the object header's codec id) into ``out`` (a writable
    buffer of plain numbers, C-contiguous, at least the decoded size; allocated when ``None``);
    returns the decoded bytes as a uint8 array (a view of ``out``). Raises :class:`CodecError` on
    corrupt, truncated or mismatched payloads, :class:`kvtier.errors.BufferError` on a bad ``out``."""
    cid = codec_id(codec)
    src = _byte_view(payload, "payload")
    needed = int(_core.codec_decoded_len(cid, src))
    target = np.empty(needed, dtype=np.uint8) if out is None else _byte_view(out, "out", writable=True)
    written = int(_core.codec_decode(cid, src, target))
    return target[:written]


class KvErrors(TypedDict):
    k: list[float]
    v: list[float]


class QuantError(TypedDict):
    """:func:`quant_error`'s report (JSON-ready)."""

    max_abs_error: float
    mean_abs_error: float
    mean_abs_value: float
    relative_error_per_layer: KvErrors
    relative_error_max: float


def quant_error(original: Any, decoded: Any, geometry: Geometry) -> QuantError:
    """Error of a ``quant`` round trip of whole ``BlockFirst`` fp16 objects (K and V only, as
    ``quant`` encodes them): max and mean absolute error, and relative error ``|x - y|_2 / |x|_2``
    per layer for K and V. ``original`` and ``decoded`` are buffers of the same number of bytes."""
    if geometry.dtype != "fp16" or geometry.extra_groups:
        raise CodecError(
            f"quant_error measures fp16 objects of K and V only; geometry is {geometry.dtype}"
            f"{' with extra groups' if geometry.extra_groups else ''}"
        )
    x8, y8 = _byte_view(original, "original"), _byte_view(decoded, "decoded")
    object_bytes = geometry.num_layers * 2 * geometry.segment_bytes
    if x8.nbytes == 0 or x8.nbytes % object_bytes:
        raise CodecError(
            f"original has {x8.nbytes} bytes; expected a positive multiple of {object_bytes} bytes "
            f"(whole objects of this geometry)"
        )
    if y8.nbytes != x8.nbytes:
        raise CodecError(f"decoded has {y8.nbytes} bytes; expected {x8.nbytes}, as many as original")
    shape = (-1, geometry.num_layers, 2, geometry.block_tokens * geometry.num_kv_heads * geometry.head_dim)
    x = x8.view(np.float16).astype(np.float32).reshape(shape)
    y = y8.view(np.float16).astype(np.float32).reshape(shape)
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
