"""Unified KV pooling (paper 003, "Unified KV Pooling to Accelerate Long-Context LLM Serving") and
the LMCache baselines of its evaluation (§V-A): ``lmcache_lp`` (LMCache + layerwise pipelining),
``lmcache_lp_async`` (+ asynchronous KV loading; with the pooled data plane, unified pooling
itself and the two halves of its ablation, §V-C). Plain ``lmcache`` (:mod:`kvtier.sched.lmcache`)
is the first baseline.

What each part of the paper is here:

- Layerwise pipelining (§II-B1): loads are :attr:`LoadMode.LAYERWISE`: layer l computes once its
  KV landed, so only the uncovered part of the load is blocked I/O (Fig. 2(b)).
- Asynchronous KV loading (§II-B2): a waiting request whose prefix sits below the device is
  fetched at once, with no compute budget (:attr:`LoadMode.ASYNC`: it waits in the fetching queue,
  the GPU keeps serving the others), so the retrieval overlaps the queueing before its prefill.
- KV orchestrator (§IV-A) and KV-passthrough (§IV-B) are data-plane mechanism, not scheduling:
  the sim config's ``pool`` section (``layout: pooled``, ``passthrough: true``; kvtier.sim.pool)
  makes the host-memory modules and SSDs one logical tier split by the bandwidth-aware allocator,
  exactly Algorithm 1 (:func:`bandwidth_aware_counts`, :func:`bandwidth_aware_partition`), and
  drops the kernel filesystem's cost per object on SSD access (§III-C: 84% of SSD retrieval time).
  Unified pooling is ``lmcache_lp_async`` on that data plane; the baselines keep ``layout:
  serial`` (one memory module and one SSD, §III-B, Fig. 5). The old names ``unified_pool``,
  ``unified_pool_orchestrator``, ``unified_pool_passthrough`` work for one release (below).
- GLT (§IV-A1): not materialised; a load's per-device counts are Algorithm 1's counts of its items.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import TypeVar

from kvtier.errors import ConfigError
from kvtier.sched.base import (
    LoadMode,
    LoadOrder,
    Policy,
    SchedulerDecision,
    SchedulerView,
    deprecated_name,
    register,
)
from kvtier.sched.batching import admit_fcfs, blocks_for, reusable_tokens, schedule_running, steady_fcfs
from kvtier.tiers import Tier

T = TypeVar("T")


def placement_ratios(bandwidths_bytes_per_s: Sequence[float]) -> list[Fraction]:
    """Eq. 1: ``p_i = b_i / sum_j b_j`` (exact fractions of the binary floats, so floors are exact)."""
    if not bandwidths_bytes_per_s or any(not (b > 0 and math.isfinite(b)) for b in bandwidths_bytes_per_s):
        raise ConfigError(f"pool bandwidths {list(bandwidths_bytes_per_s)}; expected one or more > 0")
    exact = [Fraction(b) for b in bandwidths_bytes_per_s]
    total = sum(exact, Fraction(0))
    return [b / total for b in exact]


def bandwidth_aware_counts(num_items: int, bandwidths_bytes_per_s: Sequence[float]) -> list[int]:
    """Algorithm 1 lines 4-12 (Eq. 2): each device's target count of an offload set of ``num_items``.

    First ``floor(p_i * |K|)`` each; then the remaining ``|K| - sum floors`` (fewer than N) go one
    each to the devices with the largest ``p_i`` ("distributes the remainder to the devices with
    larger p_i", §IV-A3), ties to the lower device index. (Line 10 read literally would give every
    remaining item to the single largest device; the prose, which says devices, is followed.)
    """
    if isinstance(num_items, bool) or num_items < 0:
        raise ConfigError(f"offload set of {num_items} items; expected >= 0")
    ratios = placement_ratios(bandwidths_bytes_per_s)
    counts = [math.floor(p * num_items) for p in ratios]
    remaining = num_items - sum(counts)
    by_share = sorted(range(len(ratios)), key=lambda i: (-ratios[i], i))
    for j in range(remaining):
        counts[by_share[j % len(by_share)]] += 1
    return counts


def bandwidth_aware_partition(items: Sequence[T], bandwidths_bytes_per_s: Sequence[float]) -> list[list[T]]:
    """Algorithm 1 lines 13-16: ``items`` (in layerwise order) go, in that order, to the first
    device whose offload set is below its target count: device 1 takes the first items."""
    counts = bandwidth_aware_counts(len(items), bandwidths_bytes_per_s)
    sets: list[list[T]] = []
    start = 0
    for count in counts:
        sets.append(list(items[start : start + count]))
        start += count
    return sets


def layerwise_items(num_blocks: int, num_layers: int) -> list[tuple[int, int]]:
    """An offload set of ``num_blocks`` blocks enumerated in layerwise order: ``(layer, block)``,
    all blocks of layer 0 first (§IV-A3)."""
    return [(layer, block) for layer in range(num_layers) for block in range(num_blocks)]


def admit_async(view: SchedulerView, decision: SchedulerDecision, budget: int) -> None:
    """Asynchronous KV loading (§II-B2), FCFS: a waiting request with a prefix below the device is
    fetched now (blocks permitting, no token budget: its prefill waits until the KV has landed); one
    with nothing to load is admitted by the token budget, as in :func:`admit_fcfs`. The first
    request that does not fit stops admission."""
    free_blocks = view.free_device_blocks
    running = len(view.running) + len(view.fetching)
    for r in view.waiting:
        if running >= view.max_running:
            break
        reused = reusable_tokens(r, True)
        device_blocks = blocks_for(r.cached_tokens[Tier.DEVICE], view.block_tokens)
        if reused > r.cached_tokens[Tier.DEVICE]:
            need = blocks_for(reused, view.block_tokens) - device_blocks
            if need > free_blocks:
                break
            decision.loads.append(LoadOrder(r.req_id, reused - r.cached_tokens[Tier.DEVICE], LoadMode.ASYNC))
        else:
            n = min(r.prompt_tokens - reused, budget)
            need = blocks_for(reused + n, view.block_tokens) - device_blocks
            if budget <= 0 or need > free_blocks:
                break
            decision.prefill.append((r.req_id, n))
            budget -= n
        free_blocks -= need
        running += 1


class _LmCacheBase(Policy):
    """LMCache (§II-A, Fig. 1): computed prompt KV written through to host and SSD (the engine's
    ``offload`` mode, data-plane config: :data:`kvtier.sched.data_plane.EVALUATED_ON`). Its chunk
    (one object, one file on SSD, per 256 tokens) is the sim config's ``block_tokens``, not the
    policy's."""


@register
class LmCacheLp(_LmCacheBase):
    """LMCache + layerwise pipelining (§II-B1): the hit prefix loads layer by layer (a layer of one
    chunk per copy) while the step computes; FCFS admission as vLLM."""

    name = "lmcache_lp"

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        decision = SchedulerDecision()
        budget = schedule_running(view, decision)
        admit_fcfs(view, decision, budget, load_mode=LoadMode.LAYERWISE)
        return decision

    def steady_decode(self, view: SchedulerView) -> bool:
        return steady_fcfs(view)  # FCFS batching: decodes first, nobody to admit


@register
class LmCacheLpAsync(_LmCacheBase):
    """LMCache + layerwise pipelining + asynchronous KV loading (§II-B2): hits are fetched as soon
    as the request is seen, while it would queue; layerwise loads remain for step-bound loads."""

    name = "lmcache_lp_async"

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        decision = SchedulerDecision()
        budget = schedule_running(view, decision)
        admit_async(view, decision, budget)
        return decision

    def steady_decode(self, view: SchedulerView) -> bool:
        return steady_fcfs(view)  # FCFS batching: decodes first, nobody to admit


# Unified pooling's KV orchestrator and KV-passthrough are data-plane mechanism: the sim config's
# `pool` section (layout: pooled, passthrough: true; kvtier.sim.pool). Its scheduling is
# lmcache_lp_async's. The names that carried the mechanism work for one release.
for _old, _layout, _passthrough in (
    ("unified_pool", "pooled", True),
    ("unified_pool_orchestrator", "pooled", False),
    ("unified_pool_passthrough", "serial", True),
):
    deprecated_name(_old, LmCacheLpAsync.name, {"pool": {"layout": _layout, "passthrough": _passthrough}})
