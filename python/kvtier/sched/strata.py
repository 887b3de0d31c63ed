"""``strata``: Strata's cache-aware scheduler and GPU-assisted KV I/O (Strata §4.2-4.3, Algorithm 1).

Each step, after the running requests (decodes and unfinished prefill chunks, as in every kvtier
policy), Strata forms the next prefill batch in three stages (§4.3):

1. **Deferral on delay hit** (§4.3.1). A waiting request whose missing context is being brought by
   another request is skipped this round (it keeps its place at the front of the queue, so its TTFT
   barely moves) unless the transient match is at most ``defer_threshold_tokens`` (100 in the paper).
   *In flight*: the engine's transient marks (``RequestView.in_flight_tokens``: blocks right after
   the request's device prefix that an admitted request is loading or computing now). *In queue*:
   walking the queue in order, each request marks its uncached blocks in-queue; a later request
   matching those marks is a delay hit (the engine's ``in_queue_tokens`` pre-filters, the block keys
   tell who came first).
2. **Balanced batch formation**, exactly Algorithm 1 (§4.3.2): the batch always starts with the
   queue's first request and pulls in its bundle hits (requests sharing the host context it loads);
   a request that would push the batch's load/compute ratio over ``load_compute_ratio`` (100 tokens
   loaded per new prompt token: Fig. 1's x-axis, where stalls begin) goes to a deprioritised list;
   if the batch is not full at the end of the queue the deprioritised requests fill it, in their
   original order (no starvation).
3. **Bubble filling** (§4.3.3): when the batch's estimated load (``cost.load_s``) exceeds its
   estimated compute (``cost.prefill_s``), its loads go asynchronous: the requests wait in the
   fetching queue while the engine keeps running decode steps (and prefills that need no load), and
   they prefill once their KV has landed. Otherwise loads overlap the step layer by layer.

I/O (§4.2): GPU-assisted gather/scatter kernels with a page-first host layout move large
contiguous segments, so they reach ~50 GB/s on the H200's PCIe 5.0 link (Fig. 5) where per-page
``cudaMemcpyAsync`` reaches ~22% of it (Fig. 3). The copies are the data plane's, not the policy's:
the sim config's ``load`` section (:mod:`kvtier.sched.load_path`; Strata's own is ``gpu_kernel``),
and the policy weighs a load's time as the engine prices it (``cost.load_s``).
Loads of one engine go through one I/O queue: successive asynchronous batches get successive link
priority classes, so they land in issue order (FIFO) rather than sharing the link; at most
``max_loading_batches`` are queued (double buffering: the next batch loads while the current one
computes).

Storage (§4.2.1): waiting requests whose prefix lies on SSD/remote are prefetched into host memory
while they queue (``LoadOrder(target=Tier.HOST)``); at dispatch Strata uses only what is on the device
or in host memory and computes the rest (the prefetch is best effort).

Mapping to the simulator's engine (what differs from Strata's SGLang implementation): the engine
mixes decodes into prefill steps (vLLM-style) where SGLang alternates prefill and decode batches;
a bundle hit's follower cannot share another request's load within one step, so a batch whose
loads have followers loads asynchronously and its followers are dispatched (as device hits, in the
same prefill step as their leader) when the shared load has landed.

Ablations (Strata Fig. 9) are data-plane differences: ``strata_sched`` is Strata's scheduling on
HiCache's per-page ``cudaMemcpyAsync`` copies (``strata`` with ``load: {engine: per_page}``, its
default load path); ``strata_io`` is SGLang-HiCache's FCFS scheduler on GPU-assisted I/O
(``hicache`` with ``load: {engine: gpu_kernel}``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ConfigError
from kvtier.sched.base import (
    LoadOrder,
    Policy,
    RequestView,
    SchedulerDecision,
    SchedulerView,
    register,
)
from kvtier.sched.batching import schedule_running, steady_fcfs
from kvtier.sched.hicache import HiCache
from kvtier.sched.members import ASYNC, HOST, LAYERWISE, REMOTE, SSD

DEFER_THRESHOLD_TOKENS = 100  # §4.3.1: "a default threshold of 100 active token matches"
LOAD_COMPUTE_RATIO = 100.0  # §4.3.2 / Fig. 1: tokens loaded per new input token
RATIO_UNITS = ("tokens", "seconds")


def host_load_s(view: SchedulerView, tokens: int) -> float:
    """The engine's estimate of a layerwise load of ``tokens`` from host (0 for none)."""
    return view.cost.load_s(tokens, HOST, LAYERWISE) if tokens > 0 else 0.0


@dataclass(slots=True)
class Candidate:
    """A waiting request as batch formation sees it (§4.3.2: load and compute requirements)."""

    view: RequestView
    load_tokens: int  # host-resident tokens beyond the device prefix
    new_tokens: int  # prompt tokens to compute
    need_blocks: int  # device blocks its whole prompt takes beyond its device prefix
    load_keys: tuple[int, ...] = ()  # block keys of the host part

    @classmethod
    def of(cls, r: RequestView, block_tokens: int) -> Candidate:
        # Once per waiting request per step: blocks_for, min and max spelled inline (same values).
        device, host = r.cached_tokens[0], r.cached_tokens[1]  # Tier.DEVICE, Tier.HOST
        # §4.2.1: at dispatch only device and host copies are used; storage parts are recomputed.
        prompt = r.prompt_tokens
        reusable = device + host if device + host < prompt - 1 else prompt - 1
        load = reusable - device if reusable > device else 0
        first = device // block_tokens
        keys = r.block_keys[first : first - (-load // block_tokens)] if load else ()
        need = -(-prompt // block_tokens) + (-device // block_tokens)
        return cls(r, load, prompt - reusable, need, keys)


@dataclass(slots=True)
class Member:
    candidate: Candidate
    chunk_tokens: int  # prompt tokens computed in this batch
    own_load_tokens: int  # what it loads itself (its load minus what a batch mate already loads)
    follower: bool  # a bundle hit riding on a mate's load


@dataclass
class Batch:
    """A prefill batch under formation (Algorithm 1's ``B``): token budget, running-request slots
    and free device blocks bound it; load and compute tokens decide ``loading_bound``."""

    view: SchedulerView
    budget_tokens: int
    slots: int
    free_blocks: int
    load_compute_ratio: float
    ratio_unit: str
    bundle_threshold_tokens: int
    members: list[Member] = field(default_factory=list)
    load_tokens: int = 0
    compute_tokens: int = 0
    compute_context: int = 0  # sum of chunk x context tokens (attention work)
    loading_keys: set[int] = field(default_factory=set)

    def seed(self, chunk_tokens: int, context_tokens: int) -> None:
        """Counts a running request's prefill chunk as compute already in the batch."""
        self.compute_tokens += chunk_tokens
        self.compute_context += chunk_tokens * context_tokens

    def is_full(self) -> bool:
        return self.budget_tokens <= 0 or self.slots <= 0 or self.free_blocks <= 0

    def fits(self, c: Candidate) -> bool:
        return self.budget_tokens > 0 and self.slots > 0 and c.need_blocks <= self.free_blocks

    def shared_tokens(self, c: Candidate) -> int:
        if not c.load_keys or c.load_keys[0] not in self.loading_keys:
            return 0  # keys are prefix-tree paths: a shared context shares its first block
        bt = self.view.block_tokens
        return min(sum(1 for k in c.load_keys if k in self.loading_keys) * bt, c.load_tokens)

    def is_bundle_hit(self, c: Candidate) -> bool:
        """§4.3.2: ``c`` shares the context a member loads from host (loaded once, computed twice)."""
        return self.shared_tokens(c) > self.bundle_threshold_tokens

    def loading_bound(self, c: Candidate) -> bool:
        """Whether adding ``c`` pushes the batch's load/compute ratio over the bound (§4.3.2).

        A request that adds no load never does: it only lowers the ratio.
        """
        own = c.load_tokens - self.shared_tokens(c)
        if own <= 0:
            return False
        chunk = min(c.new_tokens, self.budget_tokens)
        load, compute = self.load_tokens + own, self.compute_tokens + chunk
        if self.ratio_unit == "tokens":
            return load > self.load_compute_ratio * max(compute, 1)
        context = self.compute_context + chunk * (c.view.prompt_tokens - c.new_tokens)
        load_s = host_load_s(self.view, load)
        return load_s > self.load_compute_ratio * self.compute_s(compute, context)

    def compute_s(self, tokens: int, context_sum: int) -> float:
        """Estimated prefill time of ``tokens`` new tokens with the batch's mean context."""
        if tokens <= 0:
            return 0.0
        return self.view.cost.prefill_s(tokens, context_sum // tokens)

    def add(self, c: Candidate) -> None:
        shared = self.shared_tokens(c)
        chunk = min(c.new_tokens, self.budget_tokens)
        own = c.load_tokens - shared
        self.members.append(Member(c, chunk, own, follower=shared > 0))
        self.budget_tokens -= chunk
        self.slots -= 1
        self.free_blocks -= c.need_blocks
        self.load_tokens += own
        self.compute_tokens += chunk
        self.compute_context += chunk * (c.view.prompt_tokens - c.new_tokens)
        self.loading_keys.update(c.load_keys)


def add_bundle_hits(queue: list[Candidate], batch: Batch) -> None:
    """Algorithm 1, AddBundleHit: every queued request that bundle-hits the batch joins it."""
    for c in list(queue):
        if batch.is_bundle_hit(c) and batch.fits(c):
            batch.add(c)
            queue.remove(c)


def form_batch(queue: list[Candidate], batch: Batch) -> list[Candidate]:
    """Algorithm 1, BatchFormation: returns the requests left in the queue.

    "Full" is the engine's bounds: token budget, running slots, device blocks. A request that does
    not fit them ends formation (no overtaking past it, as SGLang's PrefillAdder).
    """
    q = list(queue)
    deprioritised: list[Candidate] = []
    if not q or not batch.fits(q[0]):
        return q
    batch.add(q.pop(0))
    add_bundle_hits(q, batch)
    while q and not batch.is_full():
        c = q[0]
        if not batch.fits(c):
            break
        q.pop(0)
        if batch.loading_bound(c):
            deprioritised.append(c)
        else:
            batch.add(c)
            add_bundle_hits(q, batch)
    for i, c in enumerate(deprioritised):
        if batch.is_full() or not batch.fits(c):
            q[:0] = deprioritised[i:]
            break
        batch.add(c)
    return q


def defer_delay_hits(view: SchedulerView, threshold_tokens: int) -> tuple[list[RequestView], list[int]]:
    """§4.3.1: splits the waiting queue into requests to schedule and delay hits to defer.

    A request is deferred when more than ``threshold_tokens`` of its context right after its device
    prefix are in flight (an admitted request loads or computes them), or when more than that many
    of its uncached tokens were marked in-queue by a request ahead of it in the queue.
    """
    bt = view.block_tokens
    # bt x (claimed keys) > threshold iff there are more than this many claimed keys.
    claimed_over = threshold_tokens // bt
    claimed: set[int] = set()
    ready: list[RequestView] = []
    deferred: list[int] = []
    for r in view.waiting:
        new_keys = r.block_keys[sum(r.cached_tokens) // bt :]
        delay_hit = r.in_flight_tokens > threshold_tokens
        # Or keys a request ahead claimed: one is enough where claimed_over is 0 (the default: 100
        # tokens, 512-token blocks), and isdisjoint stops at the first.
        if not delay_hit and r.in_queue_tokens > threshold_tokens and new_keys:
            if claimed_over == 0:
                delay_hit = not claimed.isdisjoint(new_keys)
            else:
                delay_hit = sum(map(claimed.__contains__, new_keys)) > claimed_over
        claimed.update(new_keys)
        if delay_hit:
            deferred.append(r.req_id)
        else:
            ready.append(r)
    return ready, deferred


@dataclass(slots=True)
class HeadPlan:
    """What Strata derives from the waiting head alone (deferral, candidates, prefetches): a function
    of the head's views, so it is kept while they stay the same (most steps admit nobody, and the
    engine keeps a waiting request's view while its prefix lookup stays valid)."""

    views: tuple[RequestView, ...]
    block_tokens: int
    candidates: list[Candidate]  # the requests not deferred, in queue order (never mutated)
    deferred: int  # delay hits deferred
    stored: list[tuple[int, int]]  # (req_id, storage-resident tokens) of every waiting request holding some


def fcfs_batch(queue: list[Candidate], batch: Batch) -> None:
    """Arrival order until the batch is full (the balance-off ablation)."""
    for c in queue:
        if batch.is_full() or not batch.fits(c):
            return
        batch.add(c)


@register
class Strata(Policy):
    """Strata (§4.3 scheduling + §4.2 I/O); ``io="page"`` and the ablation subclasses vary it."""

    name = "strata"

    def __init__(
        self,
        defer_threshold_tokens: int = DEFER_THRESHOLD_TOKENS,
        load_compute_ratio: float = LOAD_COMPUTE_RATIO,
        ratio_unit: str = "tokens",
        max_loading_batches: int = 2,
        defer: bool = True,
        balance: bool = True,
        bubble_filling: bool = True,
        prefetch: bool = True,
    ) -> None:
        if ratio_unit not in RATIO_UNITS:
            raise ConfigError(f"strata ratio_unit {ratio_unit!r}; expected one of {list(RATIO_UNITS)}")
        if defer_threshold_tokens < 0 or not load_compute_ratio > 0 or max_loading_batches < 1:
            raise ConfigError(
                "strata needs defer_threshold_tokens >= 0, load_compute_ratio > 0, max_loading_batches >= 1"
            )
        self.defer_threshold_tokens = defer_threshold_tokens
        self.load_compute_ratio = load_compute_ratio
        self.ratio_unit = ratio_unit
        self.max_loading_batches = max_loading_batches
        self.defer = defer
        self.balance = balance
        self.bubble_filling = bubble_filling
        self.prefetch = prefetch
        self.load_priority: dict[int, int] = {}  # fetching request -> link class of its batch
        self.deferred_total = 0  # delay hits deferred (a request counts once per round)
        self.bubble_batches = 0  # prefill batches whose loads went asynchronous
        self._head: HeadPlan | None = None  # the last step's, reused while the head is the same

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        decision = SchedulerDecision()
        budget = schedule_running(view, decision)
        batch = Batch(
            view,
            budget,
            view.max_running - len(view.running) - len(view.fetching),
            view.free_device_blocks,
            self.load_compute_ratio,
            self.ratio_unit,
            self.defer_threshold_tokens,
        )
        if decision.prefill:  # running prefill chunks (most steps: decodes only)
            running = {r.req_id: r for r in view.running}
            for rid, n in decision.prefill:
                batch.seed(n, running[rid].computed_tokens)
        head = self._plan_head(view)
        self.deferred_total += head.deferred
        fetching = {r.req_id for r in view.fetching}
        self.load_priority = {rid: p for rid, p in self.load_priority.items() if rid in fetching}
        queued_batches = set(self.load_priority.values())
        candidates = head.candidates
        if len(queued_batches) >= self.max_loading_batches:  # I/O queue full: no new loads
            candidates = [c for c in candidates if c.load_tokens == 0]
        if self.balance:
            form_batch(candidates, batch)
        else:
            fcfs_batch(candidates, batch)
        self._dispatch(view, batch, decision, max(queued_batches, default=0) + 1)
        if self.prefetch:
            self._prefetch(head, decision)
        return decision

    def steady_decode(self, view: SchedulerView) -> bool:
        # Nobody waiting or fetching: the head plan is empty (no batch, load, deferral or prefetch),
        # the load queue is empty, and what is left is schedule_running's decodes, as in fcfs. The
        # state it keeps (head plan, load priorities, counters) is what it was after the arming step.
        return steady_fcfs(view)

    def _plan_head(self, view: SchedulerView) -> HeadPlan:
        """The waiting head's plan: the last step's while the head's views are the same."""
        views, bt = tuple(view.waiting), view.block_tokens
        plan = self._head
        if plan is not None and plan.block_tokens == bt and plan.views == views:
            return plan
        ready, deferred = (
            defer_delay_hits(view, self.defer_threshold_tokens) if self.defer else (list(views), [])
        )
        stored = [(r.req_id, n) for r in views if (n := r.cached_tokens[SSD] + r.cached_tokens[REMOTE]) > 0]
        # A request whose view is the same object keeps its candidate (a function of the view).
        kept = (
            {c.view.req_id: c for c in plan.candidates}
            if plan is not None and plan.block_tokens == bt
            else {}
        )
        candidates = [
            c if (c := kept.get(r.req_id)) is not None and c.view is r else Candidate.of(r, bt) for r in ready
        ]
        plan = self._head = HeadPlan(views, bt, candidates, len(deferred), stored)
        return plan

    def _dispatch(
        self, view: SchedulerView, batch: Batch, decision: SchedulerDecision, async_priority: int
    ) -> None:
        """§4.3.3: layerwise loads, or asynchronous ones with decode steps filling the bubble."""
        if not batch.members:  # nothing to dispatch (the estimates below order nothing)
            return
        leaders = [m for m in batch.members if m.own_load_tokens > 0 and not m.follower]
        load_s = sum(host_load_s(view, m.own_load_tokens) for m in leaders)
        compute_s = batch.compute_s(batch.compute_tokens, batch.compute_context)
        bubble = self.bubble_filling and load_s > compute_s
        if bubble and leaders:
            self.bubble_batches += 1
        # A leader whose load a follower shares loads asynchronously: both prefill once it landed.
        shared = {k for m in batch.members if m.follower for k in m.candidate.load_keys}
        for m in batch.members:
            if m.follower:
                continue
            rid = m.candidate.view.req_id
            if m.own_load_tokens > 0:
                if bubble or not shared.isdisjoint(m.candidate.load_keys):
                    decision.loads.append(LoadOrder(rid, m.own_load_tokens, ASYNC, async_priority))
                    self.load_priority[rid] = async_priority
                else:  # on the step's critical path: ahead of queued asynchronous batches
                    decision.loads.append(LoadOrder(rid, m.own_load_tokens, LAYERWISE, 0))
            decision.prefill.append((rid, max(m.chunk_tokens, 1)))

    def _prefetch(self, head: HeadPlan, decision: SchedulerDecision) -> None:
        """§4.2.1: storage-resident prefixes of queued requests move to host while they wait."""
        if not head.stored:
            return
        dispatched = {rid for rid, _ in decision.prefill}
        for rid, stored in head.stored:
            if rid not in dispatched:
                decision.loads.append(LoadOrder(rid, stored, ASYNC, 2, HOST))

    def params(self) -> dict[str, Any]:
        return {
            "defer_threshold_tokens": self.defer_threshold_tokens,
            "load_compute_ratio": self.load_compute_ratio,
            "ratio_unit": self.ratio_unit,
            "max_loading_batches": self.max_loading_batches,
            "defer": self.defer,
            "balance": self.balance,
            "bubble_filling": self.bubble_filling,
            "prefetch": self.prefetch,
        }


@register
class StrataSched(Strata):
    """Strata-Schedule-Only (Fig. 9): Strata's scheduling; its paper's data plane is HiCache's
    per-page copies (:data:`kvtier.sched.data_plane.EVALUATED_ON`, ``load: {engine: per_page}``)."""

    name = "strata_sched"


@register
class StrataIo(HiCache):
    """Strata-IO (Fig. 9): SGLang-HiCache's FCFS, layerwise-overlapped scheduling (no deferral,
    balancing or bubble filling); its paper's data plane is GPU-assisted I/O (``load: {engine:
    gpu_kernel}``)."""

    name = "strata_io"
