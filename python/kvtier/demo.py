"""``kvtier demo``: multi-turn conversations whose KV goes through the store and comes back.

Each turn re-sends the whole conversation. The engine side is simulated with a real ``LayerFirst``
paged pool (Llama-3-8B geometry, synthetic KV values): the cached prefix is leased, loaded into
objects and scattered into the pool; only the new tokens' blocks are "computed" (filled with values
derived from their keys); then the conversation's new full blocks are gathered and put. Every
loaded block is checked against the values it must hold, so the demo fails loudly on wrong KV.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from kvtier.config import DramConfig, StoreConfig
from kvtier.errors import KvtierError
from kvtier.geometry import Geometry, GeometryDict
from kvtier.keys import BlockKeys
from kvtier.layout import Copier, alloc_pool
from kvtier.progress import progress
from kvtier.results import Result
from kvtier.store import Store


@dataclass(frozen=True)
class DemoTurn(Result):
    turn: int
    conversation: int
    prompt_tokens: int
    hit_tokens: int


#: The store's counters the demo reports at its end (:class:`kvtier.store.StoreStats` fields).
STORE_COUNTERS = (
    "objects", "used_bytes", "capacity_bytes", "evictions", "checksum_failures", "hit_blocks", "miss_blocks"
)  # fmt: skip


@dataclass(frozen=True)
class DemoResult(Result):
    """What ``kvtier demo`` reports."""

    geometry: GeometryDict
    conversations: int
    turns: int
    prompt_tokens: int
    hit_tokens: int
    token_hit_rate: float
    loaded_bytes: int
    put_bytes: int
    load_gib_per_s: float
    put_gib_per_s: float
    store: dict[str, int]  # STORE_COUNTERS
    per_turn: list[DemoTurn]
    demo: str = "multi-turn"


@dataclass
class Totals:
    prompt_tokens: int = 0
    hit_tokens: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    put_bytes: int = 0
    put_seconds: float = 0.0
    turns: list[DemoTurn] = field(default_factory=list)


def synthetic_block(keys: BlockKeys, index: int, block_bytes: int) -> np.ndarray:
    """The KV bytes block ``index`` 'computes' to: a function of its key alone."""
    key = keys[index]
    words = np.arange((block_bytes + 7) // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    words ^= np.uint64(key & (2**64 - 1)) ^ np.uint64(key >> 64)
    return words.view(np.uint8)[:block_bytes]


def run(
    conversations: int = 3,
    turns: int = 6,
    dram_capacity: int = 2 * 2**30,
    pool_blocks: int = 320,
    seed: int = 0,
    show: bool = True,
) -> DemoResult:
    geometry = Geometry.llama3_8b()
    store = Store(
        StoreConfig(
            geometry=geometry, model_id="demo/llama-3-8b", dram=DramConfig(capacity_bytes=dram_capacity)
        )
    )
    copier = Copier()
    pool = alloc_pool(geometry, pool_blocks)
    rng = np.random.default_rng(seed)
    histories: list[np.ndarray] = [
        rng.integers(0, 128_000, 300) for _ in range(conversations)
    ]  # system prompts
    totals = Totals()
    schedule = [(t, c) for t in range(turns) for c in range(conversations)]
    for turn, conv in progress(schedule, len(schedule), "demo", enabled=show):
        user = rng.integers(0, 128_000, int(rng.integers(40, 400)))
        prompt = np.concatenate([histories[conv], user])
        keys = store.namespace.block_keys(prompt)
        if len(keys) > pool_blocks:
            raise KvtierError(f"conversation grew to {len(keys)} blocks; the demo pool holds {pool_blocks}")
        block_ids = rng.permutation(pool_blocks)[: len(keys)]  # wherever the engine's allocator put them

        with store.lease(keys) as lease:
            hit = lease.hit_blocks
            t0 = time.perf_counter()
            loaded = np.empty((hit, geometry.block_bytes), dtype=np.uint8)
            report = store.load(lease, loaded)
            copier.scatter(geometry, loaded[: report.loaded_blocks], block_ids[: report.loaded_blocks], pool)
            totals.load_seconds += time.perf_counter() - t0
        hit = report.loaded_blocks
        for i in range(hit):  # the loaded prefix must be exactly what was computed before
            if not np.array_equal(loaded[i], synthetic_block(keys, i, geometry.block_bytes)):
                raise KvtierError(f"turn {turn} conversation {conv}: block {i} came back wrong")

        # "Prefill" the rest: the engine computes the missing blocks into its pool.
        fresh = (
            np.stack([synthetic_block(keys, i, geometry.block_bytes) for i in range(hit, len(keys))])
            if len(keys) > hit
            else np.empty((0, geometry.block_bytes), dtype=np.uint8)
        )
        copier.scatter(geometry, fresh, block_ids[hit:], pool)

        # Store what is new: gather the computed blocks out of the pool and put them.
        t0 = time.perf_counter()
        objects = copier.gather(geometry, pool, block_ids[hit:])
        put = store.put(keys[hit:], objects)
        totals.put_seconds += time.perf_counter() - t0
        if not np.array_equal(objects, fresh):
            raise KvtierError(f"turn {turn} conversation {conv}: gather returned different bytes")

        reply = rng.integers(0, 128_000, int(rng.integers(50, 300)))
        histories[conv] = np.concatenate([prompt, reply])
        totals.prompt_tokens += len(prompt)
        totals.hit_tokens += hit * geometry.block_tokens
        totals.loaded_bytes += hit * geometry.block_bytes
        totals.put_bytes += put.stored * geometry.block_bytes
        totals.turns.append(DemoTurn(turn, conv, len(prompt), hit * geometry.block_tokens))
    stats = store.stats()
    store.check_integrity()
    return DemoResult(
        geometry=geometry.to_dict(),
        conversations=conversations,
        turns=turns,
        prompt_tokens=totals.prompt_tokens,
        hit_tokens=totals.hit_tokens,
        token_hit_rate=totals.hit_tokens / max(totals.prompt_tokens, 1),
        loaded_bytes=totals.loaded_bytes,
        put_bytes=totals.put_bytes,
        load_gib_per_s=totals.loaded_bytes / max(totals.load_seconds, 1e-12) / 2**30,
        put_gib_per_s=totals.put_bytes / max(totals.put_seconds, 1e-12) / 2**30,
        store={name: int(getattr(stats, name)) for name in STORE_COUNTERS},
        per_turn=totals.turns,
    )


def summary(r: DemoResult) -> str:
    s = r.store
    lines = [
        f"kvtier demo: {r.conversations} conversations x {r.turns} turns, Llama-3-8B geometry "
        f"({r.geometry['num_layers']} layers, bf16, {r.geometry['block_tokens']}-token blocks)",
        "  turn conv  prompt_tokens  hit_tokens",
    ]
    for t in r.per_turn:
        lines.append(f"  {t.turn:4d} {t.conversation:4d}  {t.prompt_tokens:13d}  {t.hit_tokens:10d}")
    lines += [
        f"  token hit rate {r.token_hit_rate:.1%}: {r.hit_tokens} of {r.prompt_tokens} prompt tokens "
        "came from the store instead of prefill",
        f"  loaded {r.loaded_bytes / 2**30:.2f} GiB at {r.load_gib_per_s:.2f} GiB/s (lease+load+scatter); "
        f"stored {r.put_bytes / 2**30:.2f} GiB at {r.put_gib_per_s:.2f} GiB/s (gather+put)",
        f"  store: {s['objects']} objects, {s['used_bytes'] / 2**20:.0f} of {s['capacity_bytes'] / 2**20:.0f} MiB, "
        f"{s['evictions']} evictions, {s['checksum_failures']} checksum failures; every loaded block verified",
    ]
    return "\n".join(lines)
