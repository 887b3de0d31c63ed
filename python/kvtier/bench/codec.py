"""``kvtier bench codec``: codec ratios, speeds and ``quant`` error on real KV (the SmolLM2-135M
fixture, 20 fp16 ``BlockFirst`` objects), one block per chunk. Speeds are output (decoded) Gbit/s on
one core, as ShadowServe Table 1 reports them (host core: deflate 2.5, LZ4 18.6), next to a memcpy
of the same bytes measured in this run; ``--threads`` adds an all-cores decode figure."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvtier import _core, codec
from kvtier.bench.timing import best_seconds, memcpy_seconds
from kvtier.errors import KvtierError
from kvtier.geometry import Geometry

FIXTURE = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "smollm2_kv.npz"
GEOMETRY = Geometry(30, 3, 64, "fp16", 16)
LOSSLESS_BACKENDS = ("zstd", "lz4", "deflate")

# (name, key rule, value rule): CacheGen's defaults first, then uniform bins.
QUANT_CURVE: tuple[tuple[str, codec.BinRule, codec.BinRule], ...] = (
    ("cachegen", codec.CACHEGEN_KEYS, codec.CACHEGEN_VALUES),
    ("uniform_16", codec.BinRule(0, 16, 16), codec.BinRule(0, 16, 16)),
    ("uniform_8", codec.BinRule(0, 8, 8), codec.BinRule(0, 8, 8)),
    ("uniform_4", codec.BinRule(0, 4, 4), codec.BinRule(0, 4, 4)),
    ("keys_32_first_10_else_8", codec.BinRule(10, 32, 8), codec.BinRule(2, 32, 8)),
)


def load_blocks(path: Path = FIXTURE) -> np.ndarray:
    """The fixture's blocks as ``[num_blocks, block_bytes]`` uint8."""
    if not path.exists():
        raise KvtierError(f"KV fixture {path} is missing; expected tests/fixtures/smollm2_kv.npz")
    kv = np.load(path)["kv"]
    return np.ascontiguousarray(kv).reshape(kv.shape[0], -1).view(np.uint8)


def _gbit_per_s(nbytes: int, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9


def _measure(blocks: np.ndarray, cid: str, repeats: int, **kwargs: Any) -> dict[str, float]:
    payloads = [codec.encode(b, cid, geometry=GEOMETRY, **kwargs) for b in blocks]
    out = np.empty_like(blocks)
    encode_s = best_seconds(
        lambda: [codec.encode(b, cid, geometry=GEOMETRY, **kwargs) for b in blocks], repeats
    )
    ids = codec.codec_id(cid)
    decode_s = best_seconds(
        lambda: [_core.codec_decode(ids, p, o) for p, o in zip(payloads, out, strict=True)], repeats
    )
    if cid == "lossless" and not np.array_equal(out, blocks):
        raise KvtierError("lossless round trip differs from its input")
    return {
        "ratio": blocks.nbytes / sum(len(p) for p in payloads),
        "encode_gbit_per_s_per_core": _gbit_per_s(blocks.nbytes, encode_s),
        "decode_gbit_per_s_per_core": _gbit_per_s(blocks.nbytes, decode_s),
    }


def _all_cores_decode(blocks: np.ndarray, threads: int, repeats: int, **kwargs: Any) -> float:
    payloads = [codec.encode(b, "lossless", **kwargs) for b in blocks] * 4
    out = np.empty((len(payloads), blocks.shape[1]), dtype=np.uint8)
    with ThreadPoolExecutor(threads) as pool:

        def run() -> None:
            list(pool.map(lambda i: _core.codec_decode(1, payloads[i], out[i]), range(len(payloads))))

        seconds = best_seconds(run, repeats)
    return _gbit_per_s(out.nbytes, seconds)


def _quant_curve(blocks: np.ndarray) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name, keys, values in QUANT_CURVE:
        try:
            payloads = [
                codec.encode(b, "quant", geometry=GEOMETRY, key_bins=keys, value_bins=values) for b in blocks
            ]
        except codec.CodecError as exc:  # e.g. more than half the fp16 size before deflate
            rows.append({"setting": name, "refused": str(exc)})
            continue
        decoded = np.stack([codec.decode(p, "quant") for p in payloads])
        error = codec.quant_error(blocks, decoded, GEOMETRY)
        rows.append({"setting": name, "ratio": blocks.nbytes / sum(len(p) for p in payloads), **error})
    return rows


def run(repeats: int = 3, threads: int = 0, show: bool = True, agreement: bool = True) -> dict[str, Any]:
    blocks = load_blocks()
    result: dict[str, Any] = {
        "fixture": str(FIXTURE.name),
        "blocks": int(blocks.shape[0]),
        "block_bytes": int(blocks.shape[1]),
        "memcpy_gbit_per_s_per_core": _gbit_per_s(blocks.nbytes, memcpy_seconds(blocks.nbytes, repeats)),
    }
    for backend in LOSSLESS_BACKENDS:
        if show:
            print(f"bench codec: lossless {backend}", flush=True)
        m = _measure(blocks, "lossless", repeats, backend=backend)
        result[f"{backend}_lossless_ratio"] = m["ratio"]
        result[f"{backend}_decode_gbit_per_s_per_core"] = m["decode_gbit_per_s_per_core"]
        result[f"{backend}_encode_gbit_per_s_per_core"] = m["encode_gbit_per_s_per_core"]
    for backend in ("none", *LOSSLESS_BACKENDS):
        if show:
            print(f"bench codec: quant {backend}", flush=True)
        m = _measure(blocks, "quant", repeats, backend=backend)
        result[f"{backend}_quant_ratio"] = m["ratio"]
        if backend == "deflate":
            result["quant_decode_gbit_per_s_per_core"] = m["decode_gbit_per_s_per_core"]
            result["quant_encode_gbit_per_s_per_core"] = m["encode_gbit_per_s_per_core"]
    result["lossless_ratio"] = result["deflate_lossless_ratio"]
    result["quant_ratio"] = result["deflate_quant_ratio"]
    result["threads"] = threads or os.cpu_count() or 1
    # Same harness on one thread, so the scaling figure is not skewed by the pool's overhead.
    result["deflate_decode_gbit_per_s_pool_1_thread"] = _all_cores_decode(
        blocks, 1, repeats, backend="deflate"
    )
    result["deflate_decode_gbit_per_s_all_cores"] = _all_cores_decode(
        blocks, result["threads"], repeats, backend="deflate"
    )
    if show:
        print("bench codec: quant curve", flush=True)
    result["quant_curve"] = _quant_curve(blocks)
    if agreement:
        if show:
            print("bench codec: next-token agreement on SmolLM2-135M (about 20 s)", flush=True)
        result["next_token_agreement"] = _agreement()
    return result


def _agreement() -> dict[str, Any]:
    from kvtier.bench.agreement import PROMPTS, next_token_agreement
    from kvtier.engine import load

    model, tokenizer = load()
    return next_token_agreement(model, [tokenizer.encode_instruct(p) for p in PROMPTS])


def summary(result: dict[str, Any]) -> str:
    lines = [
        f"codec bench on {result['fixture']} ({result['blocks']} blocks of {result['block_bytes']} B); "
        f"memcpy {result['memcpy_gbit_per_s_per_core']:.1f} Gbit/s/core",
        "lossless (byte-plane shuffle + backend): ratio, decode / encode Gbit/s per core",
    ]
    for b in LOSSLESS_BACKENDS:
        lines.append(
            f"  {b:8s} {result[f'{b}_lossless_ratio']:.3f}x  {result[f'{b}_decode_gbit_per_s_per_core']:.2f} / "
            f"{result[f'{b}_encode_gbit_per_s_per_core']:.2f}"
        )
    lines.append(
        f"deflate decode on {result['threads']} threads: {result['deflate_decode_gbit_per_s_all_cores']:.2f} Gbit/s "
        f"(same pool, 1 thread: {result['deflate_decode_gbit_per_s_pool_1_thread']:.2f}; "
        "target per core >= 5.0; ShadowServe host core 2.5)"
    )
    ratios = ", ".join(f"{b} {result[f'{b}_quant_ratio']:.2f}x" for b in ("none", *LOSSLESS_BACKENDS))
    lines.append(f"quant (CacheGen bins) ratio: {ratios} (target >= 3.5 with deflate)")
    lines.append(
        f"quant+deflate decode / encode: {result['quant_decode_gbit_per_s_per_core']:.2f} / "
        f"{result['quant_encode_gbit_per_s_per_core']:.2f} Gbit/s per core"
    )
    for row in result["quant_curve"]:
        if "refused" in row:
            lines.append(f"  {row['setting']:24s} refused: {row['refused']}")
        else:
            lines.append(
                f"  {row['setting']:24s} {row['ratio']:.2f}x  max|e| {row['max_abs_error']:.4f}  "
                f"mean|e| {row['mean_abs_error']:.5f}  worst layer rel {row['relative_error_max']:.4f}"
            )
    if "next_token_agreement" in result:
        a = result["next_token_agreement"]
        lines.append(
            f"next-token agreement vs exact fp16 KV ({a['prompts']} prompts x {a['steps']} steps, teacher-forced):"
        )
        for name, row in a.items():
            if isinstance(row, dict):
                lines.append(
                    f"  {name:24s} {row['agreement']:.3f}  (first token {row['first_token_agreement']:.2f})"
                )
    return "\n".join(lines)
