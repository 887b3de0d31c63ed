"""``kvtier bench transfer``: the transfer engine against limits measured in the same run.

- **Pipeline** (ShadowServe §4.2-4.3): a ``--total`` (64 MiB) load of blocks that sit in an SSD
  tier configured with ``ssd.codec="quant"`` (CacheGen bins + deflate: each block is stored as
  its encoded codec object, about a quarter of its size), through read (the encoded bytes, O_DIRECT)
  → decompress → dequantize → scatter. ``bytes_read_ratio`` = bytes the read stage read from the
  tiers ÷ the decoded bytes loaded. ``pipeline_ratio_to_sequential`` = pipelined wall time ÷ the same stage code run
  one stage after another without overlap, the faster of two ways: each stage over the whole
  request with its workers (``..._to_whole_request_sequential``), or one thread taking each chunk
  through every stage in one chunk-sized region, the pipeline's buffer locality
  (``..._to_chunk_sequential``). ``pipeline_ratio_to_slowest_stage`` = pipelined ÷ the slowest
  stage's best time alone in either (1.0 is the ideal). The stage split is balanced from stage rates
  measured in a calibration run. ``preallocated_speedup`` = the "No MM" variant (every stage
  buffer allocated per chunk) ÷ the preallocated pipeline.
- **Duplex** (SuperInfer §4.3.2) on a Qwen2.5-32B-like geometry (64 layers, 8 KV heads, head dim
  128, fp16, 16-token blocks: 4 MiB blocks of 32 KiB segments): ``batched_speedup_vs_per_segment``
  = swapping N blocks out with one copy submission per (layer, block) segment ÷ one batched
  block-first submission; ``duplex_ratio_to_serial`` = swap-in and swap-out of N blocks each, at
  once ÷ one after the other. A single-threaded memcpy of the same bytes is the limit of one
  direction; ``duplex_limit_ratio`` = two such memcpys at once ÷ one after the other, the most
  this machine's memory lets two host-to-host copies overlap (on a GPU the two directions use the
  two halves of a full-duplex PCIe link instead), and ``duplex_ratio_to_limit`` = the duplex
  ratio ÷ that limit (1.0 = as good as raw copies).

  With ``--device cuda:N`` the duplex part runs on GPU ``N`` (``DuplexEngine.on_cuda``: the device
  pool in GPU memory, the host swap space pinned, one copy stream per direction; docs/transfer.md
  §6): one direction's limit is then one ``cudaMemcpyAsync`` of the same bytes over the host link,
  and ``duplex_limit_ratio`` = one such copy each way on two streams at once ÷ one after the other,
  the link's own duplex. The pipeline part stays on the host.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier import layout
from kvtier.bench.timing import TwoMemcpys, best_seconds, gib_per_s, memcpy_seconds
from kvtier.config import DramConfig, SsdConfig, StoreConfig
from kvtier.errors import ConfigError, KvtierError
from kvtier.geometry import Geometry
from kvtier.progress import progress
from kvtier.results import Result
from kvtier.store import Store
from kvtier.transfer import (
    STAGE_NAMES,
    DuplexEngine,
    TransferConfig,
    TransferEngine,
    balanced_stage_workers,
    cuda_link_duplex,
)

#: Llama-3-8B's KV shape in fp16 (``quant`` codes fp16): 2 MiB blocks.
LLAMA3_8B_FP16 = Geometry(32, 8, 128, "fp16", 16)
#: Qwen2.5-32B: 64 layers, 8 KV heads (GQA), head dim 128; fp16, 16-token blocks.
QWEN25_32B = Geometry(64, 8, 128, "fp16", 16)


@dataclass(frozen=True)
class Pipeline(Result):
    """The pipelined load of quantised blocks from SSD against its sequential baselines."""

    pipeline_geometry: str
    pipeline_codec: str
    bytes_read_ratio: float
    ssd_encoded_blocks: int
    pipeline_bytes: int
    pipeline_blocks: int
    pipeline_chunk_blocks: int
    pipeline_buffer_chunks: int
    pipeline_ssd_fraction: float
    threads: int
    calibration_stage_rates_gib_per_s: dict[str, float]
    stage_workers: dict[str, int]
    stage_seconds: dict[str, float]
    whole_request_stage_seconds: dict[str, float]
    whole_request_sequential_s: float
    sequential_s: float
    pipelined_s: float
    slowest_stage: str
    pipeline_ratio_to_sequential: float
    pipeline_ratio_to_whole_request_sequential: float
    pipeline_ratio_to_slowest_stage: float
    chunk_stage_seconds: dict[str, float]
    chunk_sequential_s: float
    pipeline_ratio_to_chunk_sequential: float
    pipelined_gib_per_s: float
    per_chunk_allocation_s: float
    preallocated_speedup: float


@dataclass(frozen=True)
class Duplex(Result):
    """Batched and duplex swaps of a Qwen2.5-32B-like request against memcpy limits."""

    duplex_geometry: str
    #: ``host`` (both pools in host memory) or ``cuda:N`` (the device pool on GPU N).
    duplex_device: str
    #: What the limits copy with: host memcpys, or one cudaMemcpyAsync per direction.
    duplex_limit_copies: str
    swap_blocks: int
    swap_bytes: int
    segments_per_block: int
    segment_bytes: int
    memcpy_gib_per_s: float
    batched_swap_out_gib_per_s: float
    per_segment_swap_out_gib_per_s: float
    batched_ratio_to_memcpy: float
    batched_speedup_vs_per_segment: float
    duplex_s: float
    serial_s: float
    duplex_ratio_to_serial: float
    memcpy_two_serial_s: float
    memcpy_two_at_once_s: float
    duplex_limit_ratio: float
    duplex_ratio_to_limit: float


@dataclass(frozen=True)
class TransferBench(Result):
    """What ``kvtier bench transfer`` reports: one flat JSON object of both parts' keys."""

    pipeline: Pipeline
    duplex: Duplex

    def as_dict(self) -> dict[str, object]:
        return {**self.pipeline.as_dict(), **self.duplex.as_dict()}


def _kv_like(n: int, block_bytes: int, seed: int = 0) -> np.ndarray:
    """fp16 values shaped like KV: mostly small, a few larger per vector."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(n * block_bytes // 2).astype(np.float32) * 0.5
    return values.astype(np.float16).view(np.uint8).reshape(n, block_bytes)


def _timed_load(engine: TransferEngine, keys: Any, pool: np.ndarray, ids: list[int]) -> float:
    start = time.perf_counter()
    [job] = engine.wait([engine.submit_load(keys, pool, ids)])
    seconds = time.perf_counter() - start
    if not job.ok:
        raise KvtierError(f"bench load failed: {job.failed[:4]}")
    return seconds


def _pipeline(total_bytes: int, repeats: int, threads: int, directory: str, steps: Any) -> Pipeline:
    geometry = LLAMA3_8B_FP16  # 2 MiB blocks
    bb = geometry.block_bytes
    n = max(1, total_bytes // bb)
    object_bytes = (bb + 64 + 4095) // 4096 * 4096
    config = StoreConfig(
        geometry=geometry,
        model_id="bench-transfer",
        dram=DramConfig(capacity_bytes=object_bytes),  # one block: every other block lives on SSD
        ssd=SsdConfig(
            directory=directory,
            capacity_bytes=(n + 8) * object_bytes,
            promote_on_hit=False,
            probe_bytes=0,
            codec="quant",
        ),
        leases_max=64,
    )
    store = Store(config)
    keys = store.namespace.block_keys(range(16 * n))
    filler = store.namespace.block_keys(range(10**6, 10**6 + 16))
    ids = list(range(n))
    src = layout.alloc_pool(geometry, n)
    layout.scatter(geometry, _kv_like(n, bb), ids, src)
    base = TransferConfig(chunk_blocks=1, buffer_chunks=4)
    calibrate = TransferEngine(store, base)
    [stored] = calibrate.wait([calibrate.submit_store(keys, src, ids)])
    # One more block pushes the last stored one out of the one-block DRAM tier, onto SSD.
    filler_pool = layout.alloc_pool(geometry, 1)
    layout.scatter(geometry, _kv_like(1, bb, seed=1), [0], filler_pool)
    [pushed] = calibrate.wait([calibrate.submit_store(filler, filler_pool, [0])])
    if not stored.ok or not pushed.ok:
        raise KvtierError(f"bench store failed: {stored.failed[:4]}")
    tiers = store.lookup(keys).tiers
    ssd_fraction = tiers.count("ssd") / n
    next(steps)

    # Calibration: per-worker stage rates from a sequential run with one worker per stage.
    pool = layout.alloc_pool(geometry, n)
    pool.fill(0)  # fault its pages in: timings measure the transfer, not first touch
    _, times = calibrate.load_sequential(keys, pool, ids)
    loaded = n * bb
    rates = [loaded / times[s] if times[s] > 0 else 0.0 for s in STAGE_NAMES]
    split = balanced_stage_workers(rates, threads)
    del calibrate
    next(steps)

    # Each chunk in flight owns one buffer region, so no more chunks than regions are worked on at
    # once: a split of W workers needs W regions or some stay idle (on 16 cores, 4 regions left
    # the 9 decompress workers waiting: pipelined 2-2.5x its slowest stage).
    sized = {**base.__dict__, "stage_workers": split, "buffer_chunks": max(base.buffer_chunks, sum(split))}
    engine = TransferEngine(store, TransferConfig(**sized))
    no_mm = TransferEngine(store, TransferConfig(**{**sized, "allocate_per_chunk": True}))
    _timed_load(engine, keys, pool, ids)  # warm-up: first reads of the device, thread start-up
    read = engine.stage_stats()[0]
    bytes_read_ratio = read.stored_bytes / read.bytes
    if not np.array_equal(pool, engine_check(engine, keys, geometry, n, ids)):
        raise KvtierError("pipelined and sequential loads differ")
    # Interleaved, best of each: the three variants see the same machine conditions.
    pipelined_s = per_chunk_s = sequential_s = chunk_sequential_s = float("inf")
    seq: dict[str, float] = {}
    chunk_seq: dict[str, float] = {}
    for _ in range(repeats):
        pipelined_s = min(pipelined_s, _timed_load(engine, keys, pool, ids))
        per_chunk_s = min(per_chunk_s, _timed_load(no_mm, keys, pool, ids))
        for per_chunk in (False, True):
            job, t = engine.load_sequential(keys, pool, ids, per_chunk=per_chunk)
            if not job.ok:
                raise KvtierError(f"sequential load failed: {job.failed[:4]}")
            if per_chunk and sum(t.values()) < chunk_sequential_s:
                chunk_sequential_s, chunk_seq = sum(t.values()), t
            if not per_chunk and sum(t.values()) < sequential_s:
                sequential_s, seq = sum(t.values()), t
    next(steps)
    del no_mm
    # Conservative: each stage's best time alone (either baseline), the faster baseline overall.
    best_stage = {stage: min(seq[stage], chunk_seq[stage]) for stage in STAGE_NAMES}
    slowest = max(best_stage.values())
    baseline_s = min(sequential_s, chunk_sequential_s)
    return Pipeline(
        pipeline_geometry="Llama-3-8B-like (32 layers, 8 KV heads, head dim 128, fp16, 16-token blocks)",
        pipeline_codec="SSD tier ssd.codec=quant (CacheGen bins + deflate level 6)",
        bytes_read_ratio=bytes_read_ratio,
        ssd_encoded_blocks=store.stats().ssd_encoded_blocks,
        pipeline_bytes=loaded,
        pipeline_blocks=n,
        pipeline_chunk_blocks=base.chunk_blocks,
        pipeline_buffer_chunks=sized["buffer_chunks"],
        pipeline_ssd_fraction=ssd_fraction,
        threads=threads,
        calibration_stage_rates_gib_per_s={s: r / 2**30 for s, r in zip(STAGE_NAMES, rates, strict=True)},
        stage_workers=dict(zip(STAGE_NAMES, split, strict=True)),
        stage_seconds=best_stage,
        whole_request_stage_seconds=seq,
        whole_request_sequential_s=sequential_s,
        sequential_s=baseline_s,
        pipelined_s=pipelined_s,
        slowest_stage=max(best_stage, key=lambda s: best_stage[s]),
        pipeline_ratio_to_sequential=pipelined_s / baseline_s,
        pipeline_ratio_to_whole_request_sequential=pipelined_s / sequential_s,
        pipeline_ratio_to_slowest_stage=pipelined_s / slowest,
        chunk_stage_seconds=chunk_seq,
        chunk_sequential_s=chunk_sequential_s,
        pipeline_ratio_to_chunk_sequential=pipelined_s / chunk_sequential_s,
        pipelined_gib_per_s=gib_per_s(loaded, pipelined_s),
        per_chunk_allocation_s=per_chunk_s,
        preallocated_speedup=per_chunk_s / pipelined_s,
    )


def engine_check(engine: TransferEngine, keys: Any, geometry: Geometry, n: int, ids: list[int]) -> np.ndarray:
    """The same blocks loaded stage after stage, into a fresh pool (a correctness cross-check)."""
    other = layout.alloc_pool(geometry, n)
    other.fill(0)
    job, _ = engine.load_sequential(keys, other, ids)
    if not job.ok:
        raise KvtierError(f"sequential load failed: {job.failed[:4]}")
    return other


def _duplex(swap_blocks: int, repeats: int, cuda_device: int | None = None) -> Duplex:
    g = QWEN25_32B
    n = swap_blocks
    bb = g.block_bytes
    host = np.ones((2 * n, bb), dtype=np.uint8)
    if cuda_device is None:
        device = layout.alloc_pool(g, 2 * n)
        device.fill(1)
        engine = DuplexEngine(g, device, host)
    else:
        engine = DuplexEngine.on_cuda(g, 2 * n, host, device=cuda_device)
        ones = np.ones(bb, dtype=np.uint8)
        for d in range(2 * n):
            engine.write_block(d, ones)
    out_pairs = [(d, d) for d in range(n)]
    in_pairs = [(n + i, n + i) for i in range(n)]  # host slot n+i → device block n+i

    def swap_out_batched() -> None:
        for d, h in out_pairs:
            engine.write(d)
            engine.swap_out(d, h)
        out_id, _ = engine.submit_step()
        engine.wait_all() if out_id is None else engine.wait(out_id)

    def swap_out_per_segment() -> None:
        last = engine.swap_out_per_segment(out_pairs)
        if last is not None:
            engine.wait(last)

    def swap_in() -> None:
        for h, d in in_pairs:
            engine.free(d)
            engine.swap_in(h, d)

    def duplex() -> None:
        for d, h in out_pairs:
            engine.write(d)
            engine.swap_out(d, h)
        swap_in()
        engine.submit_step()
        engine.wait_all()

    def serial() -> None:
        swap_out_batched()
        swap_in()
        engine.submit_step()
        engine.wait_all()

    nbytes = n * bb
    if cuda_device is None:
        memcpy_s = memcpy_seconds(nbytes, repeats)
    else:  # a swap-out's limit: one device-to-host copy of its bytes
        memcpy_s = cuda_link_duplex(nbytes, repeats, cuda_device)[1]
    batched_s = best_seconds(swap_out_batched, repeats)
    per_segment_s = best_seconds(swap_out_per_segment, repeats)
    # Interleaved, best of each over more rounds (each is a few ms): the duplex, its serial
    # baseline and the two-memcpy limit see the same machine conditions.
    duplex_s = serial_s = memcpy_serial_s = memcpy_at_once_s = float("inf")
    with contextlib.ExitStack() as stack:
        limit_round: Callable[[], tuple[float, float]]  # (one after the other, both at once) s
        if cuda_device is None:
            limit_round = stack.enter_context(TwoMemcpys(nbytes)).seconds
        else:
            gpu = cuda_device

            def limit_round() -> tuple[float, float]:
                h2d_s, d2h_s, at_once_s = cuda_link_duplex(nbytes, 1, gpu)
                return h2d_s + d2h_s, at_once_s

        for _ in range(3 * repeats):
            duplex_s = min(duplex_s, best_seconds(duplex, 1))
            serial_s = min(serial_s, best_seconds(serial, 1))
            two_serial, two_at_once = limit_round()
            memcpy_serial_s = min(memcpy_serial_s, two_serial)
            memcpy_at_once_s = min(memcpy_at_once_s, two_at_once)
    limit = memcpy_at_once_s / memcpy_serial_s
    return Duplex(
        duplex_geometry="Qwen2.5-32B-like (64 layers, 8 KV heads, head dim 128, fp16, 16-token blocks)",
        duplex_device="host" if cuda_device is None else f"cuda:{cuda_device}",
        duplex_limit_copies="host memcpys"
        if cuda_device is None
        else "one cudaMemcpyAsync per direction (pinned host memory)",
        swap_blocks=n,
        swap_bytes=nbytes,
        segments_per_block=2 * g.num_layers,
        segment_bytes=g.block_bytes // (2 * g.num_layers),
        memcpy_gib_per_s=gib_per_s(nbytes, memcpy_s),
        batched_swap_out_gib_per_s=gib_per_s(nbytes, batched_s),
        per_segment_swap_out_gib_per_s=gib_per_s(nbytes, per_segment_s),
        batched_ratio_to_memcpy=memcpy_s / batched_s,
        batched_speedup_vs_per_segment=per_segment_s / batched_s,
        duplex_s=duplex_s,
        serial_s=serial_s,
        duplex_ratio_to_serial=duplex_s / serial_s,
        memcpy_two_serial_s=memcpy_serial_s,
        memcpy_two_at_once_s=memcpy_at_once_s,
        duplex_limit_ratio=limit,
        duplex_ratio_to_limit=duplex_s / serial_s / limit,
    )


def cuda_device(text: str) -> int | None:
    """``--device``: ``host`` -> None; ``cuda`` / ``cuda:N`` -> the GPU index."""
    name, sep, index = text.partition(":")
    if text == "host":
        return None
    if name != "cuda" or (sep and not index.isdigit()):
        raise ConfigError(f"--device is {text!r}; expected host, cuda or cuda:N")
    return int(index or 0)


def run(
    total_bytes: int = 64 * 2**20,
    repeats: int = 5,
    threads: int = 0,
    swap_blocks: int = 16,
    directory: str | None = None,
    show: bool = True,
    cuda_device: int | None = None,
) -> TransferBench:
    """Both parts; ``cuda_device``: run the duplex part on that CUDA GPU (module docstring)."""
    threads = threads or os.cpu_count() or 1
    if cuda_device is not None:
        cuda_link_duplex(2**20, 1, cuda_device)  # no GPU: fail now, not after the pipeline part
    if total_bytes < 2**21:
        raise KvtierError(f"total_bytes is {total_bytes}; expected at least one 2 MiB block")
    steps = iter(progress(range(5), 5, "bench transfer", enabled=show))
    next(steps)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-transfer-", dir=directory) as tmp:
        pipeline = _pipeline(total_bytes, repeats, threads, tmp, steps)
    next(steps)
    return TransferBench(pipeline, _duplex(swap_blocks, repeats, cuda_device))


def summary(r: TransferBench) -> str:
    p, d = r.pipeline, r.duplex
    stages = "  ".join(f"{s} {p.stage_seconds[s] * 1e3:.1f} ms" for s in STAGE_NAMES)
    workers = " ".join(f"{s}={p.stage_workers[s]}" for s in STAGE_NAMES)
    return "\n".join(
        [
            f"transfer bench: {p.pipeline_bytes / 2**20:.0f} MiB {p.pipeline_codec} load, "
            f"{p.pipeline_ssd_fraction:.0%} from SSD, {p.threads} threads ({workers})",
            f"  read {p.bytes_read_ratio:.3f} of the decoded bytes from the tier (encoded blocks)",
            f"  stages alone   {stages}  (best of the two baselines)",
            f"  sequential     {p.whole_request_sequential_s * 1e3:8.1f} ms (stage after stage, whole request)",
            f"  pipelined      {p.pipelined_s * 1e3:8.1f} ms  ratio to sequential "
            f"{p.pipeline_ratio_to_sequential:.2f} (target <= 0.7), to slowest stage "
            f"{p.pipeline_ratio_to_slowest_stage:.2f}",
            f"  chunk by chunk {p.chunk_sequential_s * 1e3:8.1f} ms (one thread, one region)  "
            f"pipelined ratio {p.pipeline_ratio_to_chunk_sequential:.2f}",
            f"  per-chunk allocation {p.per_chunk_allocation_s * 1e3:8.1f} ms  preallocated speedup "
            f"{p.preallocated_speedup:.2f}x",
            f"duplex on {d.duplex_device}: {d.swap_blocks} blocks of "
            f"{d.swap_bytes // d.swap_blocks // 2**20} MiB ({d.duplex_geometry})",
            f"  swap-out batched {d.batched_swap_out_gib_per_s:.2f} GiB/s (one way's limit "
            f"{d.memcpy_gib_per_s:.2f}), "
            f"per segment {d.per_segment_swap_out_gib_per_s:.2f} GiB/s: batched speedup "
            f"{d.batched_speedup_vs_per_segment:.2f}x",
            f"  duplex in+out {d.duplex_s * 1e3:.1f} ms vs serial {d.serial_s * 1e3:.1f} ms: ratio "
            f"{d.duplex_ratio_to_serial:.2f} (target <= 0.75)",
            f"  limit ({d.duplex_limit_copies}): both at once {d.memcpy_two_at_once_s * 1e3:.1f} ms vs "
            f"one after the other {d.memcpy_two_serial_s * 1e3:.1f} ms: ratio {d.duplex_limit_ratio:.2f} "
            f"(duplex / limit {d.duplex_ratio_to_limit:.2f})",
        ]
    )
