"""``kvtier bench layout``: gather/scatter of one request between a paged pool with shuffled block
ids and BlockFirst objects, against one contiguous memcpy of the same bytes (measured here)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.bench.timing import best_seconds, gib_per_s, memcpy_seconds, touched
from kvtier.errors import KvtierError
from kvtier.geometry import Geometry, GeometryDict
from kvtier.layout import Copier, kv_view
from kvtier.progress import progress
from kvtier.results import Result


@dataclass(frozen=True)
class LayoutBench(Result):
    """What ``kvtier bench layout`` reports (GiB/s are best of ``repeats``)."""

    geometry: GeometryDict
    tokens: int
    blocks: int
    bytes: int
    segments: int
    threads: int
    repeats: int
    memcpy_gib_per_s: float
    gather_gib_per_s: float
    scatter_gib_per_s: float
    gather_per_segment_gib_per_s: float
    scatter_per_segment_gib_per_s: float
    gather_ratio_to_memcpy: float
    scatter_ratio_to_memcpy: float
    speedup_vs_per_segment: float
    gather_speedup_vs_per_segment: float
    scatter_speedup_vs_per_segment: float
    bench: str = "layout"


def run(
    tokens: int = 8192, repeats: int = 5, threads: int = 0, seed: int = 0, show: bool = True
) -> LayoutBench:
    geometry = Geometry.llama3_8b()
    num_req_blocks = tokens // geometry.block_tokens
    if num_req_blocks < 1:
        raise KvtierError(f"tokens is {tokens}; expected at least one block ({geometry.block_tokens} tokens)")
    pool_blocks = 2 * num_req_blocks
    rng = np.random.default_rng(seed)
    block_ids = rng.permutation(pool_blocks)[:num_req_blocks].astype(np.uint64)
    nbytes = num_req_blocks * geometry.block_bytes

    steps = iter(progress(range(6), 6, "bench layout", enabled=show))
    next(steps)
    pool = touched(geometry.pool_bytes(pool_blocks))
    pool.view(np.uint64)[:] = np.arange(pool.nbytes // 8, dtype=np.uint64)  # distinct words everywhere
    objects = touched(nbytes).reshape(num_req_blocks, geometry.block_bytes)
    copier = Copier(threads)

    next(steps)
    memcpy_s = memcpy_seconds(nbytes, repeats)
    next(steps)
    gather_s = best_seconds(lambda: copier.gather(geometry, pool, block_ids, objects), repeats)
    _verify_gather(geometry, pool, block_ids, objects)
    next(steps)
    gather_naive_s = best_seconds(
        lambda: copier.gather(geometry, pool, block_ids, objects, per_segment=True), repeats
    )
    next(steps)
    scatter_s = best_seconds(lambda: copier.scatter(geometry, objects, block_ids, pool), repeats)
    next(steps)
    scatter_naive_s = best_seconds(
        lambda: copier.scatter(geometry, objects, block_ids, pool, per_segment=True), repeats
    )
    for _ in steps:
        pass
    return LayoutBench(
        geometry=geometry.to_dict(),
        tokens=num_req_blocks * geometry.block_tokens,
        blocks=num_req_blocks,
        bytes=nbytes,
        segments=num_req_blocks * 2 * geometry.num_layers,
        threads=copier.threads,
        repeats=repeats,
        memcpy_gib_per_s=gib_per_s(nbytes, memcpy_s),
        gather_gib_per_s=gib_per_s(nbytes, gather_s),
        scatter_gib_per_s=gib_per_s(nbytes, scatter_s),
        gather_per_segment_gib_per_s=gib_per_s(nbytes, gather_naive_s),
        scatter_per_segment_gib_per_s=gib_per_s(nbytes, scatter_naive_s),
        gather_ratio_to_memcpy=memcpy_s / gather_s,
        scatter_ratio_to_memcpy=memcpy_s / scatter_s,
        speedup_vs_per_segment=(gather_naive_s + scatter_naive_s) / (gather_s + scatter_s),
        gather_speedup_vs_per_segment=gather_naive_s / gather_s,
        scatter_speedup_vs_per_segment=scatter_naive_s / scatter_s,
    )


def _verify_gather(geometry: Geometry, pool: np.ndarray, block_ids: np.ndarray, objects: np.ndarray) -> None:
    """Spot-checks the benchmark's own output, so a fast wrong copy cannot post a figure."""
    kv = kv_view(geometry, pool)
    for i in (0, len(block_ids) // 2, len(block_ids) - 1):
        expected = np.ascontiguousarray(kv[:, :, int(block_ids[i])]).view(np.uint8).reshape(-1)
        if not np.array_equal(objects[i], expected):
            raise KvtierError(f"gather produced wrong bytes for object {i} (pool block {block_ids[i]})")


def summary(r: LayoutBench) -> str:
    return "\n".join(
        [
            f"layout bench: {r.tokens} tokens = {r.blocks} blocks x {r.geometry['num_layers']} layers "
            f"({r.bytes / 2**30:.2f} GiB, {r.segments} segments), {r.threads} copy threads",
            f"  memcpy (limit)        {r.memcpy_gib_per_s:7.2f} GiB/s",
            f"  gather                {r.gather_gib_per_s:7.2f} GiB/s  ratio to memcpy "
            f"{r.gather_ratio_to_memcpy:.2f}",
            f"  scatter               {r.scatter_gib_per_s:7.2f} GiB/s  ratio to memcpy "
            f"{r.scatter_ratio_to_memcpy:.2f}",
            f"  per-segment gather    {r.gather_per_segment_gib_per_s:7.2f} GiB/s",
            f"  per-segment scatter   {r.scatter_per_segment_gib_per_s:7.2f} GiB/s",
            f"  speedup vs per-segment {r.speedup_vs_per_segment:.2f}x",
        ]
    )
