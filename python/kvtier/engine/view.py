"""The :class:`~kvtier.sched.SchedulerView` the engine shows its policy, built from engine state.

Nothing engine-specific leaks: requests become :class:`~kvtier.sched.RequestView` (``prompt_tokens``
is the request's prefill — the prompt, or prompt + output after a preemption by recompute — so
``computed_tokens + generated_tokens`` is the KV it holds, as the simulator's policies assume), and
cost estimates come from :class:`CpuEstimates`. A waiting request's cached prefix per tier is the
device prefix cache's hit, then what the store below holds, capped at the whole blocks before its
last prompt token (at least one token is computed: it yields the first new token's logits).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

from kvtier.engine.blocks import BlockManager
from kvtier.engine.config import EngineConfig
from kvtier.engine.hierarchy import KvTransfer
from kvtier.engine.kv import PagedKvPool
from kvtier.engine.model import Model
from kvtier.engine.request import EngineRequest
from kvtier.geometry import Geometry
from kvtier.sched.base import LoadMode, Policy, RequestView, SchedulerView
from kvtier.sched.data_plane import default_engine, policy_spec
from kvtier.sched.swap_copy import swap_engine
from kvtier.tiers import NO_TOKENS, PerTier, Tier


class EngineState(Protocol):
    """What the view reads of the engine loop (:class:`kvtier.engine.scheduler.Engine`), so that
    this module sits below the loop that imports it."""

    @property
    def config(self) -> EngineConfig: ...
    @property
    def policy(self) -> Policy: ...
    @property
    def model(self) -> Model: ...
    @property
    def pool(self) -> PagedKvPool: ...
    @property
    def blocks(self) -> BlockManager: ...
    @property
    def transfer(self) -> KvTransfer | None: ...
    @property
    def requests(self) -> Mapping[int, EngineRequest]: ...
    @property
    def waiting(self) -> Sequence[EngineRequest]: ...
    @property
    def running(self) -> Sequence[EngineRequest]: ...
    @property
    def swapped(self) -> Mapping[int, list[int]]: ...
    def now_s(self) -> float: ...
    def swap_used_blocks(self) -> int: ...


def build_view(engine: EngineState) -> SchedulerView:
    config = engine.config
    waiting = engine.waiting[: config.view_waiting_max]
    return SchedulerView(
        now_s=engine.now_s(),
        waiting=tuple(request_view(engine, r, lookup=True) for r in waiting),
        running=tuple(request_view(engine, r) for r in engine.running),
        fetching=(),
        swapped=tuple(request_view(engine, engine.requests[rid]) for rid in engine.swapped),
        free_device_blocks=engine.blocks.available(),
        # The room a swap-out can take: swap slots not held by swapped requests (slots a running
        # request keeps synced give way to a swap-out). 0, never None ("unbounded"), without swap
        # space: a swap-out there falls back to recompute.
        free_host_blocks=config.swap_blocks - engine.swap_used_blocks(),
        block_tokens=engine.pool.block_tokens,
        max_batch_tokens=config.max_batch_tokens,
        max_running=config.max_running,
        num_layers=engine.model.config.num_layers,
        cost=CpuEstimates(config, engine.pool.geometry),
        kv_bytes_per_token=engine.pool.geometry.block_bytes // engine.pool.block_tokens,
        # The engine's swaps are synchronous (docs/engine.md); the policy counts what a swap-out
        # frees by the config's swap path, else the one it was evaluated on.
        swap_copy=swap_engine(config.swap_engine or default_engine(policy_spec(engine.policy), "swap")),
    )


def request_view(engine: EngineState, r: EngineRequest, lookup: bool = False) -> RequestView:
    """``r`` as a policy sees it; with ``lookup``, its cached prefix per tier (waiting requests)."""
    bt = engine.pool.block_tokens
    cached = NO_TOKENS
    if lookup:
        cap = (r.prefill_len - 1) // bt
        device = engine.blocks.cached_prefix(r.key_ints(cap))
        per_tier = [0] * len(Tier)
        per_tier[Tier.DEVICE] = device * bt
        if engine.transfer is not None and device < cap:
            for tier in engine.transfer.lookup(r.block_keys(cap)[device:]):
                per_tier[tier] += bt
        cached = PerTier(*per_tier)
    return RequestView(
        req_id=r.req_id,
        arrival_s=r.arrival_s,
        phase=r.phase,
        prompt_tokens=r.prefill_len,
        computed_tokens=min(r.num_computed, r.prefill_len),
        generated_tokens=r.num_tokens - r.prefill_len,
        cached_tokens=cached,
        block_keys=tuple(r.key_ints(r.prefill_len // bt)),
    )


class CpuEstimates:
    """Rough CPU cost estimates for policies, from :class:`EngineConfig`'s figures over the pool's
    :class:`Geometry`."""

    def __init__(self, config: EngineConfig, geometry: Geometry) -> None:
        self._config = config
        self._geometry = geometry

    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        return new_tokens / self._config.prefill_tokens_per_s

    def load_s(self, tokens: int, tier: Tier, mode: LoadMode) -> float:
        c = self._config
        rate = {Tier.SSD: c.ssd_load_bytes_per_s, Tier.REMOTE: c.remote_load_bytes_per_s}.get(
            tier, c.host_load_bytes_per_s
        )
        g = self._geometry
        return math.ceil(tokens / g.block_tokens) * g.block_bytes / rate
