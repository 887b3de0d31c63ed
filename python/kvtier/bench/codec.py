"""``kvtier bench codec``: codec ratios, speeds and ``quant`` error on real KV (the SmolLM2-135M
fixture, 20 fp16 ``BlockFirst`` objects: :mod:`kvtier.bench.kv_fixture`, computed once where the
wheel did not ship it), one block per chunk. Speeds are output (decoded) Gbit/s on
one core, as ShadowServe Table 1 reports them (host core: deflate 2.5, LZ4 18.6), next to a memcpy
of the same bytes measured in this run; ``--threads`` adds an all-cores decode figure."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier import _core, codec
from kvtier.bench import kv_fixture
from kvtier.bench.timing import best_seconds, memcpy_seconds
from kvtier.errors import KvtierError
from kvtier.geometry import Geometry
from kvtier.results import OMIT, Result

if TYPE_CHECKING:
    from kvtier.bench.agreement import Agreement

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


@dataclass(frozen=True)
class CodecFigures(Result):
    ratio: float
    encode_gbit_per_s_per_core: float
    decode_gbit_per_s_per_core: float


@dataclass(frozen=True)
class QuantRow(Result):
    """One setting of the quant curve: its ratio and error, or why the codec refused it."""

    setting: str
    ratio: float | None = None
    error: codec.QuantError | None = None
    refused: str | None = field(default=None, metadata=OMIT)

    def as_dict(self) -> dict[str, object]:
        if self.refused is not None:
            return {"setting": self.setting, "refused": self.refused}
        return {"setting": self.setting, "ratio": self.ratio, **(self.error or {})}


@dataclass(frozen=True)
class CodecBench(Result):
    """What ``kvtier bench codec`` reports: one flat JSON object, per backend
    ``{backend}_lossless_ratio``, ``{backend}_decode/encode_gbit_per_s_per_core`` and
    ``{backend}_quant_ratio``, as it always has."""

    fixture: str
    blocks: int
    block_bytes: int
    memcpy_gbit_per_s_per_core: float
    lossless: dict[str, CodecFigures]
    quant: dict[str, CodecFigures]  # "none" and each lossless backend
    threads: int
    deflate_decode_gbit_per_s_pool_1_thread: float
    deflate_decode_gbit_per_s_all_cores: float
    quant_curve: list[QuantRow]
    next_token_agreement: Agreement | None = None

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "fixture": self.fixture,
            "blocks": self.blocks,
            "block_bytes": self.block_bytes,
            "memcpy_gbit_per_s_per_core": self.memcpy_gbit_per_s_per_core,
        }
        for backend, m in self.lossless.items():
            out[f"{backend}_lossless_ratio"] = m.ratio
            out[f"{backend}_decode_gbit_per_s_per_core"] = m.decode_gbit_per_s_per_core
            out[f"{backend}_encode_gbit_per_s_per_core"] = m.encode_gbit_per_s_per_core
        for backend, m in self.quant.items():
            out[f"{backend}_quant_ratio"] = m.ratio
        out["quant_decode_gbit_per_s_per_core"] = self.quant["deflate"].decode_gbit_per_s_per_core
        out["quant_encode_gbit_per_s_per_core"] = self.quant["deflate"].encode_gbit_per_s_per_core
        out["lossless_ratio"] = self.lossless["deflate"].ratio
        out["quant_ratio"] = self.quant["deflate"].ratio
        out["threads"] = self.threads
        out["deflate_decode_gbit_per_s_pool_1_thread"] = self.deflate_decode_gbit_per_s_pool_1_thread
        out["deflate_decode_gbit_per_s_all_cores"] = self.deflate_decode_gbit_per_s_all_cores
        out["quant_curve"] = [row.as_dict() for row in self.quant_curve]
        if self.next_token_agreement is not None:
            out["next_token_agreement"] = self.next_token_agreement.as_dict()
        return out


def load_blocks(path: Path) -> np.ndarray:
    """The fixture's blocks (:func:`kv_fixture.load_kv`) as ``[num_blocks, block_bytes]`` uint8."""
    kv = kv_fixture.load_kv(path)
    return np.ascontiguousarray(kv).reshape(kv.shape[0], -1).view(np.uint8)


def _gbit_per_s(nbytes: int, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9


def _measure(blocks: np.ndarray, cid: str, repeats: int, **kwargs: Any) -> CodecFigures:
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
    return CodecFigures(
        ratio=blocks.nbytes / sum(len(p) for p in payloads),
        encode_gbit_per_s_per_core=_gbit_per_s(blocks.nbytes, encode_s),
        decode_gbit_per_s_per_core=_gbit_per_s(blocks.nbytes, decode_s),
    )


def _all_cores_decode(blocks: np.ndarray, threads: int, repeats: int, **kwargs: Any) -> float:
    payloads = [codec.encode(b, "lossless", **kwargs) for b in blocks] * 4
    out = np.empty((len(payloads), blocks.shape[1]), dtype=np.uint8)
    with ThreadPoolExecutor(threads) as pool:

        def run() -> None:
            list(pool.map(lambda i: _core.codec_decode(1, payloads[i], out[i]), range(len(payloads))))

        seconds = best_seconds(run, repeats)
    return _gbit_per_s(out.nbytes, seconds)


def _quant_curve(blocks: np.ndarray) -> list[QuantRow]:
    rows: list[QuantRow] = []
    for name, keys, values in QUANT_CURVE:
        try:
            payloads = [
                codec.encode(b, "quant", geometry=GEOMETRY, key_bins=keys, value_bins=values) for b in blocks
            ]
        except codec.CodecError as exc:  # e.g. more than half the fp16 size before deflate
            rows.append(QuantRow(name, refused=str(exc)))
            continue
        decoded = np.stack([codec.decode(p, "quant") for p in payloads])
        error = codec.quant_error(blocks, decoded, GEOMETRY)
        rows.append(QuantRow(name, blocks.nbytes / sum(len(p) for p in payloads), error))
    return rows


def run(repeats: int = 3, threads: int = 0, show: bool = True, agreement: bool = True) -> CodecBench:
    fixture = kv_fixture.fixture_path()  # computed first (stderr says so) where the wheel lacks it
    blocks = load_blocks(fixture)
    memcpy = _gbit_per_s(blocks.nbytes, memcpy_seconds(blocks.nbytes, repeats))
    lossless: dict[str, CodecFigures] = {}
    for backend in LOSSLESS_BACKENDS:
        if show:
            print(f"bench codec: lossless {backend}", flush=True)
        lossless[backend] = _measure(blocks, "lossless", repeats, backend=backend)
    quant: dict[str, CodecFigures] = {}
    for backend in ("none", *LOSSLESS_BACKENDS):
        if show:
            print(f"bench codec: quant {backend}", flush=True)
        quant[backend] = _measure(blocks, "quant", repeats, backend=backend)
    threads = threads or os.cpu_count() or 1
    # Same harness on one thread, so the scaling figure is not skewed by the pool's overhead.
    one_thread = _all_cores_decode(blocks, 1, repeats, backend="deflate")
    all_cores = _all_cores_decode(blocks, threads, repeats, backend="deflate")
    if show:
        print("bench codec: quant curve", flush=True)
    curve = _quant_curve(blocks)
    agreed = None
    if agreement:
        if show:
            print("bench codec: next-token agreement on SmolLM2-135M (about 20 s)", flush=True)
        agreed = _agreement()
    return CodecBench(
        fixture=fixture.name,
        blocks=int(blocks.shape[0]),
        block_bytes=int(blocks.shape[1]),
        memcpy_gbit_per_s_per_core=memcpy,
        lossless=lossless,
        quant=quant,
        threads=threads,
        deflate_decode_gbit_per_s_pool_1_thread=one_thread,
        deflate_decode_gbit_per_s_all_cores=all_cores,
        quant_curve=curve,
        next_token_agreement=agreed,
    )


def _agreement() -> Agreement:
    from kvtier.bench.agreement import PROMPTS, next_token_agreement
    from kvtier.engine import load

    model, tokenizer = load()
    return next_token_agreement(model, [tokenizer.encode_instruct(p) for p in PROMPTS])


def summary(r: CodecBench) -> str:
    lines = [
        f"codec bench on {r.fixture} ({r.blocks} blocks of {r.block_bytes} B); "
        f"memcpy {r.memcpy_gbit_per_s_per_core:.1f} Gbit/s/core",
        "lossless (byte-plane shuffle + backend): ratio, decode / encode Gbit/s per core",
    ]
    for b, m in r.lossless.items():
        lines.append(
            f"  {b:8s} {m.ratio:.3f}x  {m.decode_gbit_per_s_per_core:.2f} / {m.encode_gbit_per_s_per_core:.2f}"
        )
    lines.append(
        f"deflate decode on {r.threads} threads: {r.deflate_decode_gbit_per_s_all_cores:.2f} Gbit/s "
        f"(same pool, 1 thread: {r.deflate_decode_gbit_per_s_pool_1_thread:.2f}; "
        "target per core >= 5.0; ShadowServe host core 2.5)"
    )
    ratios = ", ".join(f"{b} {m.ratio:.2f}x" for b, m in r.quant.items())
    lines.append(f"quant (CacheGen bins) ratio: {ratios} (target >= 3.5 with deflate)")
    deflate = r.quant["deflate"]
    lines.append(
        f"quant+deflate decode / encode: {deflate.decode_gbit_per_s_per_core:.2f} / "
        f"{deflate.encode_gbit_per_s_per_core:.2f} Gbit/s per core"
    )
    for row in r.quant_curve:
        if row.refused is not None or row.error is None:
            lines.append(f"  {row.setting:24s} refused: {row.refused}")
        else:
            e = row.error
            lines.append(
                f"  {row.setting:24s} {row.ratio:.2f}x  max|e| {e['max_abs_error']:.4f}  "
                f"mean|e| {e['mean_abs_error']:.5f}  worst layer rel {e['relative_error_max']:.4f}"
            )
    if r.next_token_agreement is not None:
        a = r.next_token_agreement
        lines.append(
            f"next-token agreement vs exact fp16 KV ({a.prompts} prompts x {a.steps} steps, teacher-forced):"
        )
        for name, v in a.variants.items():
            lines.append(f"  {name:24s} {v.agreement:.3f}  (first token {v.first_token_agreement:.2f})")
    return "\n".join(lines)
