"""``dualpath``: DualPath's adaptive request scheduler (DualPath §6) and its read-path choice (§4.1).

DualPath serves agentic traffic on a P/D-disaggregated cluster whose prefill engines (PEs) and
decode engines (DEs) each own one GPU; engines are organised in groups (all engines of a node in one
group, a group is all PEs or all DEs, §6.1). A request's hit KV is read from storage either into the
PE's node buffer (*PE read path*) or into the DE's node buffer and then streamed to the PE over the
compute network (*DE read path*, §4.1). Scheduling has two levels:

* **Inter-engine** (§6.1), pure functions on :class:`EngineLoad` reports, testable on hand-built
  reports, driven by :class:`DualPathScheduler` (a :class:`~kvtier.sched.placement.GlobalScheduler`,
  the interface the routers of colocated clusters share):

  - :func:`pe_category` / :func:`schedule_pe_fetch`: when a PE group fetches, each engine is
    *overloaded* (unfinished tokens ``t > beta``), on a node with a *short* disk read queue
    (``q <= alpha``) or a *long* one; FIFO over the waiting queue, each request goes to the PE with the
    fewest unfinished tokens among the short-queue engines, else the long-queue ones; when both are
    empty the fetch ends.
  - :func:`assign_de_groups` (DE phase 1): the global DE queue is drained, each request to the DE
    group with the smallest total unfinished tokens.
  - :func:`schedule_de_group` (DE phase 2): within a group, the set ``S`` of queue-head requests that
    fit in the group's summed free HBM gives the high-token threshold ``Z`` (mean tokens per DE once
    ``S`` is placed); each request goes to a DE with room, preferring DEs at or below ``Z`` (fewest
    unfinished requests first), else the high-token DE with the fewest tokens; no DE with room ends
    the fetch.
  - :func:`choose_read_path`: read on the side whose node has the shorter disk read queue (§6.1
    "KV-Cache Read Task Scheduling").

* **Intra-engine** (§6.2), :class:`DualPath` ``.schedule(view)``: a PE packs its forward batch in
  FIFO order while the estimated attention time stays within the *compute quota* (300 ms, App. A.4);
  the request that would pass it is cut by binary search on its new-token count and prefilled in
  chunks (:func:`pack_compute_quota`). KV of hit tokens streams in layer by layer (layerwise prefill,
  §2.1/§4). DEs put every running request in the batch.

The paper's ablation (§7.5, Fig. 12) switches these parts off: layerwise prefill (data-plane config,
the sim config's ``io: {layerwise: false}``, :mod:`kvtier.sched.kv_io`: the whole batch's KV in HBM,
loaded before compute; the policy reads it as ``view.layerwise_prefill``), ``read_paths="pe"``
(storage→PE only), ``scheduler="round_robin"`` (engines and read side in turn instead of §6.1).
``dualpath_basic`` is all three off: the paper's *Basic* (its paper's data plane is ``io:
{engine: blocking}``); ``dualpath_oracle`` decides as DualPath on ``io: {engine: oracle}``.

alpha and beta (App. A.4: "the number of tokens we can read during alpha seconds", "the number of tokens one
GPU can process for beta seconds") lost their values in our copy of the paper; the defaults are ours
(:data:`SHORT_READ_QUEUE_S`, :data:`UNFINISHED_LIMIT_S`), one value for every experiment.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import IntEnum
from typing import Any

from kvtier.errors import ConfigError
from kvtier.sched.base import LoadMode, LoadOrder, Policy, SchedulerDecision, SchedulerView, register
from kvtier.sched.placement import (
    ClusterState,
    EngineLoad,
    GlobalScheduler,
    PendingRequest,
    Placement,
    Role,
)
from kvtier.tiers import Tier

COMPUTE_QUOTA_S = 0.3  # App. A.4: "Compute Quota Threshold is set to 300ms"
# App. A.4's alpha and beta (values missing from our copy): the short read queue holds what a node's storage
# NIC reads in 1 s; a PE is overloaded past the prompt tokens a GPU prefills in 4 s (the online TTFT
# SLO, §7.4: more queued work than that misses it anyway).
SHORT_READ_QUEUE_S = 1.0
UNFINISHED_LIMIT_S = 4.0
READ_PATHS = ("dual", "pe")
SCHEDULERS = ("dualpath", "round_robin")
# §6.1: "all engines in one group proactively fetch tasks together regularly": the global scheduler
# runs at most once per interval, when something changed (an arrival, a finished step or read).
FETCH_INTERVAL_S = 0.05


# ----------------------------------------------------------------------------------------------
# Inter-engine scheduling (§6.1)


class Category(IntEnum):
    """§6.1's three PE categories."""

    OVERLOADED = 1  # t_e > beta: gets nothing
    SHORT_QUEUE = 2  # t_e <= beta and q <= alpha: preferred, its storage NIC would otherwise idle
    LONG_QUEUE = 3  # t_e <= beta and q > alpha


def pe_category(e: EngineLoad, short_queue_tokens: int, unfinished_limit_tokens: int) -> Category:
    """The §6.1 category of a PE from its report."""
    return _category(e.unfinished_tokens, e.read_queue_tokens, short_queue_tokens, unfinished_limit_tokens)


def _category(tokens: int, queue_tokens: int, short_queue_tokens: int, limit_tokens: int) -> Category:
    if tokens > limit_tokens:
        return Category.OVERLOADED
    if queue_tokens <= short_queue_tokens:
        return Category.SHORT_QUEUE
    return Category.LONG_QUEUE


def schedule_pe_fetch(
    waiting: Iterable[PendingRequest],
    engines: Sequence[EngineLoad],
    short_queue_tokens: int,
    unfinished_limit_tokens: int,
) -> list[tuple[int, int]]:
    """PE scheduling for one group's fetch (§6.1, Fig. 5): ``(req_id, engine_id)`` in FIFO order.

    After each assignment only the chosen PE's ``t`` grows (its node's read queue changes once the
    read is issued, after the DE is chosen). Stops at the first request no PE may take.
    """
    tokens = {e.engine_id: e.unfinished_tokens for e in engines}
    out: list[tuple[int, int]] = []
    for req in waiting:
        best: EngineLoad | None = None
        for category in (Category.SHORT_QUEUE, Category.LONG_QUEUE):
            members = [
                e
                for e in engines
                if _category(
                    tokens[e.engine_id], e.read_queue_tokens, short_queue_tokens, unfinished_limit_tokens
                )
                is category
            ]
            if members:
                best = min(members, key=lambda e: (tokens[e.engine_id], e.engine_id))
                break
        if best is None:
            break  # both categories empty: the fetch ends
        tokens[best.engine_id] += req.tokens
        out.append((req.req_id, best.engine_id))
    return out


def assign_de_groups(
    queue: Sequence[PendingRequest], groups: Mapping[int, Sequence[EngineLoad]]
) -> dict[int, list[PendingRequest]]:
    """DE phase 1 (§6.1): drains the global queue, each request to the group with the least total
    unfinished tokens (ties: lowest group id), updating that total."""
    totals = {g: sum(e.unfinished_tokens for e in engines) for g, engines in groups.items()}
    out: dict[int, list[PendingRequest]] = {g: [] for g in groups}
    for req in queue:
        g = min(totals, key=lambda g: (totals[g], g))
        out[g].append(req)
        totals[g] += req.tokens
    return out


def schedule_de_group(
    private_queue: Sequence[PendingRequest],
    engines: Sequence[EngineLoad],
    hbm_tokens: Callable[[PendingRequest], int],
) -> list[tuple[int, int]]:
    """DE phase 2 (§6.1): ``(req_id, engine_id)`` from the head of a group's private queue.

    ``hbm_tokens(req)`` is the KV a request takes on a DE (prompt plus output). ``S`` is the longest
    queue head whose summed need fits the group's summed free HBM (no fragmentation); the high-token
    threshold is ``Z = (Σ t_e + Σ_{S} tokens) / #DEs``. Stops at the first request no DE has room for.
    """
    free = {e.engine_id: e.free_hbm_tokens for e in engines}
    tokens = {e.engine_id: e.unfinished_tokens for e in engines}
    count = {e.engine_id: e.unfinished_requests for e in engines}
    room = sum(free.values())
    fitted = 0
    for req in private_queue:  # S: an upper bound of what this fetch can place
        if hbm_tokens(req) > room:
            break
        room -= hbm_tokens(req)
        fitted += req.tokens
    threshold = (sum(tokens.values()) + fitted) / max(len(engines), 1)
    out: list[tuple[int, int]] = []
    for req in private_queue:
        need = hbm_tokens(req)
        fits = [e.engine_id for e in engines if free[e.engine_id] >= need]
        if not fits:
            break
        low = [i for i in fits if tokens[i] <= threshold]
        if low:  # keep token counts balanced; among them balance request counts
            chosen = min(low, key=lambda i: (count[i], tokens[i], i))
        else:  # all have high tokens: the least loaded, to lower HBM exhaustion / preemption risk
            chosen = min(fits, key=lambda i: (tokens[i], i))
        free[chosen] -= need
        tokens[chosen] += req.tokens
        count[chosen] += 1
        out.append((req.req_id, chosen))
    return out


def choose_read_path(pe_queue_tokens: int, de_queue_tokens: int) -> str:
    """§6.1: read on the side whose node has the shorter disk read queue ("pe" on a tie)."""
    return "de" if de_queue_tokens < pe_queue_tokens else "pe"


class DualPathScheduler(GlobalScheduler):
    """DualPath's global scheduler (§6.1) on a cluster of PE and DE groups: arrivals queue; each
    fetch lets the PE groups take from the queue in turn (:func:`schedule_pe_fetch`), drains the
    global DE queue into the groups' private queues (:func:`assign_de_groups`), places their heads
    on DEs (:func:`schedule_de_group`) and picks each read's side (:func:`choose_read_path`). With
    the ablation's ``scheduler="round_robin"`` every arrival is placed at once instead: engines
    and (with two read paths) read sides in turn.

    ``short_queue_tokens`` and ``unfinished_limit_tokens`` are App. A.4's alpha and beta in tokens
    (the cluster converts the policy's seconds with its NIC and GPU rates)."""

    name = "dualpath"
    topology = "node_groups"

    def __init__(self, policy: DualPath, short_queue_tokens: int, unfinished_limit_tokens: int) -> None:
        self.read_paths = policy.read_paths
        self.round_robin = policy.scheduler == "round_robin"
        self.fetch_interval_s = None if self.round_robin else FETCH_INTERVAL_S
        self.short_queue_tokens = short_queue_tokens
        self.unfinished_limit_tokens = unfinished_limit_tokens
        self.waiting: deque[PendingRequest] = deque()  # global PE queue (FIFO)
        self.de_queue: list[PendingRequest] = []  # PE assigned, waiting for DE phase 1
        self.private: dict[int, list[PendingRequest]] = {}  # DE group -> phase 1's private queue
        self._pe: dict[int, int] = {}  # req_id -> its PE, until its DE is chosen
        self._rr_group = self._rr_pe = self._rr_de = self._rr_side = 0

    def pending(self) -> int:
        return len(self.waiting)

    def arrive(self, req: PendingRequest, cluster: ClusterState) -> None:
        if not self.round_robin:
            self.waiting.append(req)
            return
        pes, des = cluster.loads(Role.PREFILL), cluster.loads(Role.DECODE)
        pe, de = pes[self._rr_pe % len(pes)], des[self._rr_de % len(des)]
        self._rr_pe += 1
        self._rr_de += 1
        side = "pe"
        if self.read_paths == "dual":
            side = "pe" if self._rr_side % 2 == 0 else "de"
            self._rr_side += 1
        cluster.place(Placement(req.req_id, pe.engine_id, Role.PREFILL))
        cluster.place(Placement(req.req_id, de.engine_id, Role.DECODE, side))

    def fetch(self, cluster: ClusterState) -> None:
        if not (self.waiting or self.de_queue or any(self.private.values())):
            return
        n = cluster.groups(Role.PREFILL)
        for k in range(n):  # PE groups fetch in turn
            if not self.waiting:
                break
            reports = cluster.loads(Role.PREFILL, (self._rr_group + k) % n)
            # Lazily: the fetch stops at the first request no PE takes (long queues cost O(taken)).
            for rid, eid in schedule_pe_fetch(
                iter(self.waiting), reports, self.short_queue_tokens, self.unfinished_limit_tokens
            ):
                req = self.waiting.popleft()
                assert req.req_id == rid, "PE fetch assigns the waiting queue's head in order"
                self._pe[rid] = eid
                cluster.place(Placement(rid, eid, Role.PREFILL))
                self.de_queue.append(req)
        self._rr_group += 1
        if self.de_queue:  # DE phase 1: the global queue drains into the groups' private queues
            groups = {g: cluster.loads(Role.DECODE, g) for g in range(cluster.groups(Role.DECODE))}
            for gi, reqs in assign_de_groups(self.de_queue, groups).items():
                self.private.setdefault(gi, []).extend(reqs)
            self.de_queue.clear()
        for gi, queue in sorted(self.private.items()):  # DE phase 2
            if not queue:
                continue
            reports = cluster.loads(Role.DECODE, gi)
            placed = schedule_de_group(queue, reports, _decode_tokens)
            for rid, eid in placed:
                side = "pe"
                if self.read_paths == "dual":
                    pe_queue = cluster.read_queue_tokens(self._pe[rid])
                    side = choose_read_path(pe_queue, cluster.read_queue_tokens(eid))
                del self._pe[rid]
                cluster.place(Placement(rid, eid, Role.DECODE, side))
            del queue[: len(placed)]


def _decode_tokens(req: PendingRequest) -> int:
    """The KV a request takes on a DE: prompt plus output."""
    return req.tokens + req.output_tokens


# ----------------------------------------------------------------------------------------------
# Intra-engine scheduling (§6.2)


def pack_compute_quota(
    candidates: Sequence[tuple[int, int, int]],
    batch_time_s: Callable[[Sequence[tuple[int, int]]], float],
    quota_s: float,
) -> list[tuple[int, int]]:
    """FIFO packing under a compute quota (§6.2, Fig. 6).

    ``candidates`` are ``(req_id, cached_tokens, remaining_tokens)`` in FIFO order;
    ``batch_time_s`` estimates the batch's attention time from its ``(cached, new)`` pairs. Whole
    requests are added while the estimate stays within ``quota_s``; the first that would pass it is
    cut to the largest new-token count that fits (binary search) and prefilled in chunks. The head
    request always gets at least one token, so a lone oversized request still progresses.
    """
    pairs: list[tuple[int, int]] = []
    out: list[tuple[int, int]] = []
    for req_id, cached, remaining in candidates:
        if remaining <= 0:
            continue
        if batch_time_s([*pairs, (cached, remaining)]) <= quota_s:
            pairs.append((cached, remaining))
            out.append((req_id, remaining))
            continue
        lo, hi = 0, remaining  # largest n in [0, remaining) that fits; time is monotone in n
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if batch_time_s([*pairs, (cached, mid)]) <= quota_s:
                lo = mid
            else:
                hi = mid
        if lo == 0 and not out:
            lo = 1
        if lo > 0:
            out.append((req_id, lo))
        break
    return out


@register
class DualPath(Policy):
    """DualPath (§4-§6). Parameters switch the §7.5 ablation's parts; see the module docs."""

    name = "dualpath"
    global_scheduler = "dualpath"  # its inter-engine half: DualPathScheduler (§6.1)

    def __init__(
        self,
        compute_quota_s: float = COMPUTE_QUOTA_S,
        read_paths: str = "dual",
        scheduler: str = "dualpath",
        short_read_queue_s: float = SHORT_READ_QUEUE_S,
        unfinished_limit_s: float = UNFINISHED_LIMIT_S,
    ) -> None:
        if not compute_quota_s > 0:
            raise ConfigError(f"dualpath compute_quota_s is {compute_quota_s}; expected > 0")
        if read_paths not in READ_PATHS:
            raise ConfigError(f"dualpath read_paths is {read_paths!r}; expected one of {READ_PATHS}")
        if scheduler not in SCHEDULERS:
            raise ConfigError(f"dualpath scheduler is {scheduler!r}; expected one of {SCHEDULERS}")
        if not (short_read_queue_s >= 0 and unfinished_limit_s > 0):
            raise ConfigError("dualpath short_read_queue_s must be >= 0 and unfinished_limit_s > 0")
        self.compute_quota_s = compute_quota_s
        self.read_paths = read_paths
        self.scheduler = scheduler
        self.short_read_queue_s = short_read_queue_s
        self.unfinished_limit_s = unfinished_limit_s

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        """One engine's forward batch: every decode, then prefill packed under the compute quota."""
        decision = SchedulerDecision()
        candidates: list[tuple[int, int, int]] = []
        loadable: dict[int, int] = {}
        for r in view.running:
            if r.computed_tokens >= r.prompt_tokens:
                decision.decode.append(r.req_id)  # DEs batch every running request (§6.2)
            else:
                candidates.append((r.req_id, r.computed_tokens, r.remaining_prefill_tokens))
        for r in view.waiting:
            cached = min(sum(r.cached_tokens), r.prompt_tokens - 1)
            loadable[r.req_id] = cached - r.cached_tokens[Tier.DEVICE]
            candidates.append((r.req_id, cached, r.prompt_tokens - cached))

        def batch_time_s(pairs: Sequence[tuple[int, int]]) -> float:
            return sum(view.cost.prefill_s(new, cached) for cached, new in pairs if new > 0)

        free_blocks = view.free_device_blocks
        layerwise = view.layerwise_prefill  # the engine's data plane (kvtier.sched.kv_io)
        mode = LoadMode.LAYERWISE if layerwise else LoadMode.SYNC
        # The engine's own bounds still hold (the reference engine's token budget and slots).
        budget = view.max_batch_tokens - len(decision.decode)
        slots = view.max_running - len(view.running)
        for req_id, n in pack_compute_quota(candidates, batch_time_s, self.compute_quota_s):
            n = min(n, budget)
            if n <= 0:
                break
            if req_id in loadable:  # a waiting request takes a running slot
                if slots <= 0:
                    break
                slots -= 1
            budget -= n
            load = loadable.get(req_id, 0)
            if not layerwise:  # the batch's whole KV sits in HBM (no layerwise prefill, §2.1)
                cached = next(c for i, c, _ in candidates if i == req_id)
                need = -(-(cached + n) // view.block_tokens)
                if need > free_blocks and decision.prefill:
                    break
                free_blocks -= need
            if load > 0:
                decision.loads.append(LoadOrder(req_id, load, mode))
            decision.prefill.append((req_id, n))
        return decision

    def params(self) -> dict[str, Any]:
        return {
            "compute_quota_s": self.compute_quota_s,
            "read_paths": self.read_paths,
            "scheduler": self.scheduler,
            "short_read_queue_s": self.short_read_queue_s,
            "unfinished_limit_s": self.unfinished_limit_s,
        }


@register
class DualPathBasic(DualPath):
    """The paper's *Basic* (§7.2): storage→PE reads only, round-robin engines; on its paper's data
    plane, no layerwise prefill (``io: {engine: blocking}``)."""

    name = "dualpath_basic"

    def __init__(self, **params: Any) -> None:
        defaults: dict[str, Any] = {"read_paths": "pe", "scheduler": "round_robin"}
        super().__init__(**{**defaults, **params})


@register
class DualPathOracle(DualPath):
    """The paper's *Oracle* (§7.2): DualPath's decisions on its paper's data plane with every disk
    read, H2D/D2H and P/D KV transfer bypassed (``io: {engine: oracle}``), the zero-I/O bound."""

    name = "dualpath_oracle"
