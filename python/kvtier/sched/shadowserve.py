"""``shadowserve_async``: ShadowServe's control plane (asynchronous fetching with batch interception,
§4.1) over its SmartNIC data plane (the four-stage chunked pipeline, §4.2-§4.3).

**Batch interception (§4.1, Fig. 6).** Each iteration the scheduler forms its batch FCFS: running
requests first (decodes, and the last prompt tokens of requests back from a fetch), then waiting
requests while the token budget, the running bound and the device blocks allow. A new request's
whole prompt is given device blocks when it is first scheduled (vLLM's lazy allocation, §4.1: the
fetch can start only after it). The KV cache manager then makes its two-way exchange, atomic from the
scheduler's view:

1. every newly scheduled *prefill* whose prompt KV is held below the device (the remote store) is
   stripped from the batch and put in the fetching queue: a :class:`LoadOrder` with
   ``mode=ASYNC, target=Tier.DEVICE``. The engine takes the request out of the running set
   (``Phase.FETCHING``) while the others keep computing. Decodes are never intercepted.
2. requests whose fetch completed rejoin the scheduler: the engine puts them back in the running
   set when their KV has landed (``Engine._start_fetch``), and the next batch gives them their last
   prompt token, piggybacked on the decodes. The last token is never fetched: "marking the last
   token of the request as not yet prefilled" lets the first output token be sampled from real
   hidden states (the engine always computes >= 1 prompt token).

The manager's fetching queue is FIFO and it fetches one request at a time ("simple FIFO queues; the
manager processes fetch jobs serially", §4.1). kvtier starts every intercepted fetch at once (so each
holds its device blocks from interception on, as in the paper) but gives each a lower link priority
class than those queued before it; kvtier's links serve the most urgent class only, so the head of
the queue has every stage to itself and the rest wait: serial FIFO fetching.

**Data plane (§4.2-§4.3, §6.3).** An intercepted fetch is a compressed load (``compressed=True``):
the engine moves it through its fetch path, data-plane config (the sim config's ``fetch`` section,
:class:`~kvtier.sched.fetch_path.FetchPath`): ShadowServe's BlueField-3 chunked pipeline
(``engine: bluefield3``, the default for this policy) or CacheGen-Async's GPU decoder
(``engine: cachegen_gpu``, :mod:`kvtier.sched.cachegen_async`). How much a fetch slows the model
while it runs (the path's ``interference``, duty-cycled by its decoder) is the engine's to work out
from its fetch path when it starts the fetch; the order names only the tokens, mode and priority.

**Bounded buffers and rounds (§4.3).** ShadowServe stages a request through fixed 0.5 GiB buffers
in rounds of chunks and scatters each round into paged KV with one small GPU kernel. The buffers sit
outside the KV pool and the per-round pipeline fill (a few ms against ~0.1-1 s fetches) is not
modelled; what bounds fetching here is the serial FIFO queue and the device blocks each intercepted
request holds. The scatter kernel's slowdown is the fetch path's ``interference`` (0 on the
BlueField-3: "this memory copy kernel causes negligible overhead", §4.3).

``fetch_mode="sync"`` is the paper's "No AF" ablation (§6.4): the same data plane, but the fetch
blocks the step (``LoadMode.SYNC``), so running decodes wait for it.
"""

from __future__ import annotations

from typing import Any

from kvtier.errors import ConfigError
from kvtier.sched.base import (
    LoadMode,
    LoadOrder,
    Policy,
    RequestView,
    SchedulerDecision,
    SchedulerView,
    register,
)
from kvtier.sched.batching import blocks_for, reusable_tokens, schedule_running, steady_fcfs
from kvtier.tiers import Tier

FETCH_MODES = ("async", "sync")


class BatchInterception(Policy):
    """Asynchronous fetching with batch interception (§4.1), shared by ShadowServe and the
    CacheGen-Async baseline (which the paper equips with this same design, §6.1). How a fetch
    moves its bytes is the engine's fetch path (data-plane config), not the policy's."""

    def __init__(self, fetch_mode: str = "async", serial_fetch: bool = True) -> None:
        if fetch_mode not in FETCH_MODES:
            raise ConfigError(f"fetch_mode is {fetch_mode!r}; expected one of {list(FETCH_MODES)}")
        self.fetch_mode = fetch_mode
        self.serial_fetch = serial_fetch
        self._fetch_class: dict[int, int] = {}  # req_id -> link priority class of its fetch

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        decision = SchedulerDecision()
        # Running requests first: decodes, and the last prompt token of requests whose fetch has
        # completed (② in Fig. 6, "piggybacked immediately in the next batch").
        budget = schedule_running(view, decision)
        self._admit_and_intercept(view, decision, budget)
        return decision

    def steady_decode(self, view: SchedulerView) -> bool:
        # Nobody waiting, fetching or swapped: schedule_running's decodes, nothing to admit or
        # intercept. The state a step keeps (the fetch classes of fetching requests) is empty after
        # every such step, the arming one included, so steps not asked change nothing of it.
        return steady_fcfs(view)

    def forget_landed(self, view: SchedulerView) -> None:
        """Drops the fetch classes of requests no longer fetching (their fetch has landed)."""
        fetching = {r.req_id for r in view.fetching}
        self._fetch_class = {rid: c for rid, c in self._fetch_class.items() if rid in fetching}

    def intercept(self, r: RequestView, tokens: int) -> LoadOrder:
        """① in Fig. 6: ``r`` goes to the fetching queue, behind the fetches already queued."""
        priority = self._next_class()
        if self.serial_fetch:
            self._fetch_class[r.req_id] = priority
        return self.fetch_order(r, tokens, LoadMode.ASYNC, priority)

    def _admit_and_intercept(self, view: SchedulerView, decision: SchedulerDecision, budget: int) -> None:
        self.forget_landed(view)
        # Keep a block per running request free, so decodes can grow without preempting anyone
        # (vLLM keeps a watermark of free blocks when it admits; kvtier preempts by recompute).
        free_blocks = view.free_device_blocks - len(view.running)
        running = len(view.running)
        scheduled = 0  # requests this loop put in the batch
        for r in view.waiting:
            if budget <= 0 or running >= view.max_running:
                break
            # The whole prompt gets its blocks at first scheduling (§4.1); FCFS, no overtaking.
            need = blocks_for(r.prompt_tokens, view.block_tokens) - blocks_for(
                r.cached_tokens[Tier.DEVICE], view.block_tokens
            )
            if need > free_blocks:
                break
            free_blocks -= need
            reused = reusable_tokens(r, True)
            fetched = reused - r.cached_tokens[Tier.DEVICE]
            new_tokens = r.prompt_tokens - r.cached_tokens[Tier.DEVICE]  # what the scheduler put in its batch
            if fetched <= 0:  # not in the store: an ordinary prefill
                decision.prefill.append((r.req_id, min(r.prompt_tokens - reused, budget)))
                budget -= new_tokens
                running += 1
                scheduled += 1
                continue
            if new_tokens > budget and scheduled:  # no chunked prefill (§4.1): the whole prompt fits
                break
            budget -= new_tokens  # the scheduler counted it before the manager stripped it
            scheduled += 1
            if self.fetch_mode == "sync":  # No AF (§6.4): the step waits for the fetch
                decision.loads.append(self.fetch_order(r, fetched, LoadMode.SYNC, 1))
                decision.prefill.append((r.req_id, r.prompt_tokens - reused))
                running += 1
                continue
            decision.loads.append(self.intercept(r, fetched))

    def _next_class(self) -> int:
        """The link priority class of the next fetch: one after every queued fetch (FIFO), so it
        waits for them on every stage; 1 (the class of ordinary loads) when none is queued.

        Classes above 2 rank below write-backs (``EngineConfig.offload_priority``); its paper's
        engine writes nothing back (offload ``none``, :mod:`kvtier.sched.data_plane`)."""
        if not self.serial_fetch:
            return 1
        return max(self._fetch_class.values(), default=0) + 1

    def fetch_order(self, r: RequestView, tokens: int, mode: LoadMode, priority: int) -> LoadOrder:
        """A compressed fetch of ``tokens``: how it moves, and how much it slows the model while it
        runs, is the engine's fetch path (data-plane config), not the order's."""
        return LoadOrder(r.req_id, tokens, mode, priority=priority, target=Tier.DEVICE, compressed=True)

    def params(self) -> dict[str, Any]:
        return {"fetch_mode": self.fetch_mode, "serial_fetch": self.serial_fetch}


@register
class ShadowServeAsync(BatchInterception):
    name = "shadowserve_async"

    # §6.1 runs against a store that other servers filled (a preloaded tier here): this engine keeps
    # nothing below the device (its paper's offload mode, kvtier.sched.data_plane). In a run with
    # no preload, the sim config's ``offload: {mode: write_through}`` lets it fill the store itself,
    # as the cluster's other engines would (data-plane config, not the policy's).
