"""A DualPath cluster (DualPath §4-§6): PE and DE groups, two KV read paths, traffic isolation.

Built by :func:`run_dualpath` when a config's policy is a :class:`~kvtier.sched.dualpath.DualPath`
(``dualpath``, ``dualpath_basic``, ``dualpath_oracle``); ``prefill_engines`` / ``decode_engines``
count GPUs (one engine per GPU, §4), ``gpus_per_node`` of the hardware profile packs them into
nodes, and each node is one engine group (§6.1).

Resources, per node and per GPU (hardware profile numbers):

- one **storage NIC** per node (``storage_nic_bytes_per_s`` x GPUs per node; 400 Gbps on the
  paper's testbed, §7.2) in front of a **disk read queue**: reads wait FIFO and at most
  :data:`READ_WINDOW` run at once; the queue's length in tokens is what engines report (``q``).
  Groups fetch work every :data:`FETCH_INTERVAL_S` while something changed.
  Storage objects are *full blocks* (all layers of ``block_tokens`` tokens, App. A.5). DE writes of
  new KV go out the same NIC (its other direction).
- one **compute NIC** per GPU (``compute_nic_bytes_per_s`` per direction). Every byte in or out of a
  GPU crosses it (§5.2, CNIC-assisted H2D/D2H): layerwise KV streaming into the PE (from its own
  buffer: loopback; from a DE buffer: the DE's CNIC out and the PE's in), prompt KV to the DE buffer
  and the DE's H2D. Streams move *layer blocks* (one layer of a block, App. A.5).
- **traffic isolation** (§5.1): the model's EP all-to-all runs in priority class 0, KV transfers in
  class 1, KV writes in class 2 (:class:`~kvtier.sim.resources.Link` is strictly prioritised: KV
  uses the bandwidth the collectives leave). Policy ``traffic_isolation: false`` puts KV in class 0.

Engines:

- **PE groups** step in lockstep (DP attention + EP FFN, §6.2): each PE packs its batch with the
  policy's ``schedule`` (compute quota, binary-search chunking); a group step computes the slowest
  PE's attention, the group's FFN (its tokens' linear FLOPs spread evenly over its GPUs), and waits
  for its EP all-to-all on every CNIC. Layerwise prefill: a batch's context KV streams in during
  the step, which ends at ``max(compute end, last KV landed + one layer)``; without it (Basic), the
  batch's KV must fit in HBM and the step computes after its load.
- **DEs** decode every running request each step (§6.2). To keep the event count low a DE advances
  its batch :data:`DECODE_TOKENS_PER_EVENT` tokens per event (less if a request finishes sooner);
  a request whose KV lands mid-run joins at the next event. On finishing, the request's new KV
  (append + generated tokens) is written to storage.

Requests: an agent's turn has its previous turn's whole blocks in storage (DualPath App. A.4:
hits only within a trajectory, no eviction); the rest is computed. TTFT is the PE's first token,
TTST the DE's first decode step.

Modelling gaps (docs/papers/dualpath.md): DRAM and PCIe are not separate resources (the paper's
§4.2 shows they are not bottlenecks at these P/D ratios); the EP all-to-all is one transfer per
step at the step's start (not per layer); the storage backend never limits a NIC; decode
collectives are not modelled.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvtier.errors import ConfigError, SimError
from kvtier.sched.base import Phase, RequestView, SchedulerView
from kvtier.sched.dualpath import (
    DualPath,
    EngineLoad,
    PendingRequest,
    assign_de_groups,
    choose_read_path,
    schedule_de_group,
    schedule_pe_fetch,
)
from kvtier.sim.config import SimConfig
from kvtier.sim.core import EventKind, EventLoop
from kvtier.sim.cost import BANDWIDTH_EFFICIENCY, MFU_DECODE, MFU_PREFILL, STEP_OVERHEAD_S
from kvtier.sim.hardware import HardwareProfile, load_hardware
from kvtier.sim.metrics import LogHistogram, Metrics, RequestRecord
from kvtier.sim.models import ModelProfile, load_model
from kvtier.sim.request import Request
from kvtier.sim.resources import Direction, Link, Transfer

READ_WINDOW = 1  # storage reads in flight per storage NIC: FIFO at the NIC's rate; the rest queue
# §6.1: "all engines in one group proactively fetch tasks together regularly": the global scheduler
# runs at most once per interval, when something changed (an arrival, a finished step or read).
FETCH_INTERVAL_S = 0.05
TTFT_WINDOW_S = 150.0  # §7.4: the steady-state test's sliding window
DECODE_TOKENS_PER_EVENT = 16  # decode tokens a DE advances per simulated event (see the module docs)
MODEL_PRIORITY = 0  # §5.1: inference collectives in the high-priority virtual lane
KV_PRIORITY = 1  # §5.1: KV traffic in the low-priority lane
ACTIVATION_RESERVE_BYTES = 4 * 2**30  # as kvtier.sim.run: activations and CUDA context
# EP all-to-all bytes per token and MoE layer: an FP8 dispatch (1 byte per hidden value) and a bf16
# combine (2 bytes), DeepEP's normal kernels; a token crosses to each other node once (§7.1 DeepEP).
A2A_BYTES_PER_HIDDEN = 3


@dataclass(eq=False)
class _Req:
    req: Request
    hit_tokens: int
    pe: int = -1
    de: int = -1
    side: str = "pe"  # where its hit KV was read to: "pe" or "de" buffer
    computed_tokens: int = 0
    generated_tokens: int = 0
    ready: bool = False  # hit KV is in a buffer
    first_token_s: float | None = None
    max_tbt_s: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return self.req.prompt_tokens


@dataclass(eq=False)
class _Node:
    index: int
    snic: Link
    reads: deque[tuple[int, int, Callable[[], None]]] = field(default_factory=deque)
    reads_in_flight: int = 0
    read_queue_tokens: int = 0  # queued + in flight (the §6.1 ``q``)


@dataclass(eq=False)
class _Engine:
    engine_id: int
    node: _Node
    cnic: Link
    unfinished_requests: int = 0
    unfinished_tokens: int = 0
    queue: list[_Req] = field(default_factory=list)  # PE: assigned, hit KV read; DE: running
    incoming: list[_Req] = field(default_factory=list)  # DE: KV landed, joins at the next event
    free_hbm_tokens: int = 0  # DE: KV tokens its HBM still holds
    stepping: bool = False


@dataclass(eq=False)
class _Group:
    index: int
    engines: list[_Engine]
    stepping: bool = False
    private_queue: list[PendingRequest] = field(default_factory=list)  # DE phase 1 → phase 2


class EpCost:
    """Step times of one GPU under DP attention + EP MoE (the roofline of kvtier.sim.cost with the
    experts spread over ``ep`` GPUs; prefill is compute bound, decode reads its weight share)."""

    def __init__(self, hw: HardwareProfile, model: ModelProfile) -> None:
        self.hw = hw
        self.model = model
        self.kv_bytes_per_token = model.kv_bytes_per_token
        idx = (model.index_head_dim + 4) * model.num_layers if model.index_topk else 0
        self.indexer_bytes_per_token = idx
        self.prefill_flops_per_s = hw.gpu_bf16_flops_per_s * MFU_PREFILL

    def attention_s(self, new_tokens: int, context_tokens: int) -> float:
        return self.model.attention_flops(new_tokens, context_tokens) / self.prefill_flops_per_s

    def linear_s(self, tokens: int) -> float:
        return tokens * self.model.linear_flops_per_token / self.prefill_flops_per_s

    def weight_bytes_per_gpu(self, ep: int) -> float:
        m = self.model
        return (m.total_params - m.routed_expert_params * (1 - 1 / ep)) * m.weight_dtype_bytes

    def decode_step_s(self, contexts: Sequence[int], ep: int) -> float:
        m = self.model
        if not contexts:
            return 0.0
        # attention_flops(1, c) summed in closed form: c + 1 pairs per token, top-k of them attended
        context = sum(contexts)
        attended = (
            sum(min(c + 1, m.index_topk) for c in contexts) if m.index_topk else context + len(contexts)
        )
        per_pair = 2.0 * m.num_attention_heads * (m.qk_head_dim + m.v_head_dim)
        indexer = 2.0 * m.index_n_heads * m.index_head_dim * (context + len(contexts))
        flops = len(contexts) * m.linear_flops_per_token + m.num_layers * (per_pair * attended + indexer)
        compute_s = flops / (self.hw.gpu_bf16_flops_per_s * MFU_DECODE)
        if m.index_topk:  # sparse attention reads the top-k latents and every indexer key
            read = sum(min(c, m.index_topk) for c in contexts)
            kv = read * (self.kv_bytes_per_token - self.indexer_bytes_per_token)
            kv += context * self.indexer_bytes_per_token
        else:
            kv = context * self.kv_bytes_per_token
        memory_s = (self.weight_bytes_per_gpu(ep) + kv) / (self.hw.hbm_bytes_per_s * BANDWIDTH_EFFICIENCY)
        return max(compute_s, memory_s) + STEP_OVERHEAD_S


class _Estimates:
    """What the policy's compute quota weighs (§6.2): a request's attention time on one GPU."""

    def __init__(self, cost: EpCost) -> None:
        self._cost = cost

    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        return self._cost.attention_s(new_tokens, context_tokens)

    def load_s(self, tokens: int, tier: str, mode: Any, segment_tokens: int | None) -> float:
        return 0.0


class DualPathCluster:
    """PE/DE groups, nodes with storage and compute NICs, the global scheduler (§6.1)."""

    def __init__(self, config: SimConfig, policy: DualPath) -> None:
        if not config.disaggregated:
            raise ConfigError("policy dualpath needs `prefill_engines` and `decode_engines` (GPUs)")
        self.config = config
        self.policy = policy
        self.zero_io = bool(getattr(policy, "zero_io", False))
        self.hw = load_hardware(config.hardware)
        self.model = load_model(config.model)
        self.cost = EpCost(self.hw, self.model)
        self.loop = EventLoop()
        self.metrics = Metrics(slo_ttft_s=config.slo.get("ttft_s"), slo_tpot_s=config.slo.get("tpot_s"))
        self.ttst = LogHistogram()
        # Online runs: TTFT of requests arriving in the horizon's second half (past the warm-up of
        # agents arriving into an empty cluster), for the steady-state SLO check of §7.4.
        self.measure_from_s = config.max_sim_s / 2 if config.max_sim_s is not None else 0.0
        self.late_ttft = LogHistogram()
        # TTFT by window of first-token time (sum, count): its trend tells a steady state from a
        # slowly filling queue (§7.4's steady-state test compares sliding windows).
        self.ttft_windows: dict[int, list[float]] = {}
        self.block_tokens = config.block_tokens
        self.links: dict[str, Link] = {}
        g = self.hw.gpus_per_node
        for what, n in (
            ("prefill_engines", config.prefill_engines),
            ("decode_engines", config.decode_engines),
        ):
            if n % g:
                raise ConfigError(f"`{what}` is {n}; expected a multiple of {g} GPUs per node")
        self.pe_groups = self._groups("p", config.prefill_engines // g, 0)
        self.de_groups = self._groups("d", config.decode_engines // g, len(self.pe_groups))
        self.pes = [e for grp in self.pe_groups for e in grp.engines]
        self.des = [e for grp in self.de_groups for e in grp.engines]
        self.by_id = {e.engine_id: e for e in self.pes + self.des}
        self.bytes_written = 0  # new KV persisted by DEs (full blocks, §4.1)
        weights = self.cost.weight_bytes_per_gpu(len(self.des))
        hbm = self.hw.hbm_capacity_bytes * config.gpu_memory_utilization - weights - ACTIVATION_RESERVE_BYTES
        if hbm <= 0:
            raise SimError(f"{self.model.name!r} leaves no HBM for KV on a DE of {self.hw.name!r}")
        for de in self.des:
            de.free_hbm_tokens = int(hbm // self.cost.kv_bytes_per_token)
        pe_weights = self.cost.weight_bytes_per_gpu(len(self.pes))
        pe_hbm = self.hw.hbm_capacity_bytes * config.gpu_memory_utilization - pe_weights
        self.pe_hbm_blocks = max(
            1, int((pe_hbm - ACTIVATION_RESERVE_BYTES) // self._bytes(self.block_tokens))
        )
        # §6.1 / App. A.4 thresholds in tokens: alpha s of one node's storage NIC, beta s of one GPU's
        # prefill of the workload's mean request shape (profiled in advance).
        snic = self.hw.storage_nic_bytes_per_s * g
        self.short_queue_tokens = int(policy.short_read_queue_s * snic / self.cost.kv_bytes_per_token)
        self.unfinished_limit_tokens = self._gpu_tokens_per_s() * policy.unfinished_limit_s
        self.waiting: deque[_Req] = deque()  # global PE queue (FIFO)
        self.de_queue: list[_Req] = []  # PE assigned, waiting for phase 1
        self.requests: dict[int, _Req] = {}
        self._children: dict[int, list[Request]] = {}
        self._next_hit: dict[int, int] = {}
        self._source: Iterator[Request] | None = None
        self._kick_pending = False
        self._rr_pe = self._rr_de = self._rr_side = 0
        self._rr_group = 0
        self.pe_busy_s = 0.0

    # Construction -------------------------------------------------------------------------------

    def _groups(self, prefix: str, nodes: int, first_node: int) -> list[_Group]:
        g = self.hw.gpus_per_node
        snic_bw = self.hw.storage_nic_bytes_per_s * g
        cnic_bw = self.hw.compute_nic_bytes_per_s
        if snic_bw <= 0 or cnic_bw <= 0:
            raise ConfigError(f"dualpath needs storage and compute NICs; {self.hw.name!r} lacks one")
        groups = []
        for n in range(nodes):
            name = f"{prefix}{n}"
            node = _Node(first_node + n, Link(self.loop, f"{name}.snic", snic_bw, snic_bw))
            self.links[node.snic.name] = node.snic
            engines = []
            for i in range(g):
                cnic = Link(self.loop, f"{name}.gpu{i}.cnic", cnic_bw, cnic_bw)
                self.links[cnic.name] = cnic
                engines.append(_Engine(len(self.links), node, cnic))
            groups.append(_Group(n, engines))
        return groups

    def _bytes(self, tokens: int) -> int:
        return tokens * self.cost.kv_bytes_per_token

    def _gpu_tokens_per_s(self) -> float:
        """Prompt tokens (hit + new) one PE prefills per second for the workload's mean shape."""
        spec = dict(self.config.workload)
        new = float(spec.get("append_tokens_mean") or 429.0)
        context = 32_721.0  # DualPath Table 2, 64K MAL (the workload's reused context)
        if spec.get("dataset") in ("32k", "48k"):
            context = {"32k": 17_183.0, "48k": 25_120.0}[str(spec["dataset"])]
        step = self.cost.attention_s(int(new), int(context)) + self.cost.linear_s(int(new))
        return (new + context) / step

    # Arrivals -----------------------------------------------------------------------------------

    def feed(self, requests: Iterator[Request]) -> None:
        self._source = requests
        self._pull()

    def _pull(self) -> None:
        assert self._source is not None
        for req in self._source:
            if req.parent_id is not None:
                self._children.setdefault(req.parent_id, []).append(req)
                continue
            self.loop.schedule(req.arrival_s, EventKind.ARRIVAL, partial(self._arrive, req, True))
            return

    def _arrive(self, req: Request, pull: bool) -> None:
        hit = min(self._next_hit.pop(req.req_id, 0), req.prompt_tokens - 1)
        r = _Req(req, hit, computed_tokens=hit)
        self.requests[req.req_id] = r
        if self.policy.scheduler == "round_robin":
            self._assign_round_robin(r)
        else:
            self.waiting.append(r)
            self.kick()
        if pull:
            self._pull()

    # Global scheduling (§6.1) -----------------------------------------------------------------

    def kick(self) -> None:
        if not self._kick_pending and self.policy.scheduler == "dualpath":
            self._kick_pending = True
            self.loop.after(FETCH_INTERVAL_S, EventKind.WAKE, self._schedule)

    def _report(self, e: _Engine, group: int) -> EngineLoad:
        return EngineLoad(
            e.engine_id,
            group,
            e.unfinished_requests,
            e.unfinished_tokens,
            e.node.read_queue_tokens,
            e.free_hbm_tokens,
        )

    def _schedule(self) -> None:
        self._kick_pending = False
        if not (self.waiting or self.de_queue or any(g.private_queue for g in self.de_groups)):
            return
        by_id = self.by_id
        n = len(self.pe_groups)
        for k in range(n):  # PE groups fetch in turn
            if not self.waiting:
                break
            group = self.pe_groups[(self._rr_group + k) % n]
            reports = [self._report(e, group.index) for e in group.engines]
            # Lazily: the fetch stops at the first request no PE takes (long queues cost O(taken)).
            heads = (PendingRequest(r.req.req_id, r.prompt_tokens, r.hit_tokens) for r in self.waiting)
            for rid, eid in schedule_pe_fetch(
                heads, reports, self.short_queue_tokens, int(self.unfinished_limit_tokens)
            ):
                r = self.waiting.popleft()
                assert r.req.req_id == rid, "PE fetch assigns the waiting queue's head in order"
                self._take(by_id[eid], r)
                r.pe = eid
                self.de_queue.append(r)
        self._rr_group += 1
        if self.de_queue:  # DE phase 1: the global queue drains into the groups' private queues
            groups = {g.index: [self._report(e, g.index) for e in g.engines] for g in self.de_groups}
            pending = [PendingRequest(r.req.req_id, r.prompt_tokens, r.hit_tokens) for r in self.de_queue]
            for gi, reqs in assign_de_groups(pending, groups).items():
                self.de_groups[gi].private_queue.extend(reqs)
            self.de_queue.clear()
        for group in self.de_groups:  # DE phase 2
            if not group.private_queue:
                continue
            reports = [self._report(e, group.index) for e in group.engines]
            placed = schedule_de_group(group.private_queue, reports, self._de_need)
            for rid, eid in placed:
                r = self.requests[rid]
                de = by_id[eid]
                self._take(de, r)
                de.free_hbm_tokens -= self._de_need_tokens(r)
                r.de = eid
                pe = by_id[r.pe]
                side = "pe"
                if self.policy.read_paths == "dual":
                    side = choose_read_path(pe.node.read_queue_tokens, de.node.read_queue_tokens)
                self._read(r, pe, de, side)
            del group.private_queue[: len(placed)]

    def _de_need(self, p: PendingRequest) -> int:
        return self._de_need_tokens(self.requests[p.req_id])

    def _de_need_tokens(self, r: _Req) -> int:
        return r.prompt_tokens + r.req.output_tokens

    @staticmethod
    def _take(e: _Engine, r: _Req) -> None:
        e.unfinished_requests += 1
        e.unfinished_tokens += r.prompt_tokens

    @staticmethod
    def _drop(e: _Engine, r: _Req) -> None:
        e.unfinished_requests -= 1
        e.unfinished_tokens -= r.prompt_tokens

    def _assign_round_robin(self, r: _Req) -> None:
        """The ablation's scheduler: engines and (with two paths) read sides in turn."""
        pe = self.pes[self._rr_pe % len(self.pes)]
        de = self.des[self._rr_de % len(self.des)]
        self._rr_pe += 1
        self._rr_de += 1
        side = "pe"
        if self.policy.read_paths == "dual":
            side = "pe" if self._rr_side % 2 == 0 else "de"
            self._rr_side += 1
        r.pe, r.de = pe.engine_id, de.engine_id
        self._take(pe, r)
        self._take(de, r)
        de.free_hbm_tokens -= self._de_need_tokens(r)
        self._read(r, pe, de, side)

    # Storage reads (§4.1) -----------------------------------------------------------------------

    def _read(self, r: _Req, pe: _Engine, de: _Engine, side: str) -> None:
        r.side = side
        node = pe.node if side == "pe" else de.node

        def landed() -> None:
            r.ready = True
            pe.queue.append(r)
            self._kick_pe(pe)
            self.kick()

        if r.hit_tokens == 0 or self.zero_io:
            self.loop.after(0.0, EventKind.TRANSFER_DONE, landed)
            return
        node.read_queue_tokens += r.hit_tokens
        node.reads.append((r.hit_tokens, self._bytes(r.hit_tokens), landed))
        self._next_read(node)

    def _next_read(self, node: _Node) -> None:
        while node.reads and node.reads_in_flight < READ_WINDOW:
            tokens, nbytes, landed = node.reads.popleft()
            node.reads_in_flight += 1

            def done(_t: Transfer, tokens: int = tokens, landed: Callable[[], None] = landed) -> None:
                node.reads_in_flight -= 1
                node.read_queue_tokens -= tokens
                landed()
                self._next_read(node)

            # Full blocks: all layers of block_tokens tokens per storage object (App. A.5).
            node.snic.submit(nbytes, Direction.IN, done, self._bytes(self.block_tokens), KV_PRIORITY)

    # PE groups (§6.2) ---------------------------------------------------------------------------

    def _pe_group_of(self, pe: _Engine) -> _Group:
        return self.pe_groups[pe.node.index]

    def _kick_pe(self, pe: _Engine) -> None:
        group = self._pe_group_of(pe)
        if not group.stepping:
            group.stepping = True
            self.loop.after(0.0, EventKind.WAKE, partial(self._pe_step, group))

    def _pe_view(self, pe: _Engine) -> SchedulerView:
        running: list[RequestView] = []
        waiting: list[RequestView] = []
        for r in pe.queue:
            started = r.computed_tokens > r.hit_tokens
            view = RequestView(
                req_id=r.req.req_id,
                arrival_s=r.req.arrival_s,
                phase=Phase.RUNNING if started else Phase.WAITING,
                prompt_tokens=r.prompt_tokens,
                computed_tokens=r.computed_tokens if started else 0,
                generated_tokens=0,
                cached_tokens=(0, 0 if started else r.hit_tokens, 0, 0),
            )
            (running if started else waiting).append(view)
        layers = self.model.num_layers
        blocks = self.pe_hbm_blocks * (layers if self.policy.layerwise else 1)
        return SchedulerView(
            now_s=self.loop.now_s,
            waiting=tuple(waiting),
            running=tuple(running),
            fetching=(),
            swapped=(),
            free_device_blocks=blocks,
            free_host_blocks=None,
            block_tokens=self.block_tokens,
            max_batch_tokens=2**31,
            max_running=2**31,
            num_layers=layers,
            cost=_Estimates(self.cost),
            kv_bytes_per_token=self.cost.kv_bytes_per_token,
        )

    def _pe_step(self, group: _Group) -> None:
        """One lockstep forward of a PE group: every PE's quota-packed batch (§6.2)."""
        plans: list[tuple[_Engine, list[tuple[_Req, int]]]] = []
        for pe in group.engines:
            if pe.queue:
                decision = self.policy.schedule(self._pe_view(pe))
                chunks = [(self.requests[rid], n) for rid, n in decision.prefill if n > 0]
                if chunks:
                    plans.append((pe, chunks))
        if not plans:
            group.stepping = False
            return
        group.stepping = True
        attention = [
            sum(self.cost.attention_s(n, r.computed_tokens) for r, n in chunks) for _, chunks in plans
        ]
        tokens = sum(n for _, chunks in plans for _, n in chunks)
        compute_s = max(attention) + self.cost.linear_s(tokens) / len(group.engines) + STEP_OVERHEAD_S
        start = self.loop.now_s
        io = self._pe_step_io(plans)
        pending = [len(io)]
        done_at = {"load": start, "a2a": start}

        def finish_at() -> float:
            if self.policy.layerwise:  # the last layer computes once its KV is in
                load_end = done_at["load"] + compute_s / self.model.num_layers
                return max(start + compute_s, load_end, done_at["a2a"])
            return max(done_at["load"] + compute_s, done_at["a2a"])

        def end() -> None:
            self._pe_step_end(group, plans, start)

        def landed(kind: str, _t: Transfer) -> None:
            done_at[kind] = max(done_at[kind], self.loop.now_s)
            pending[0] -= 1
            if pending[0] == 0:
                end_s = finish_at()
                self.metrics.blocked_io_s += max(0.0, end_s - (start + compute_s))
                self.loop.schedule(end_s, EventKind.STEP_END, end)

        if not io:
            self.loop.schedule(finish_at(), EventKind.STEP_END, end)
            return
        for link, nbytes, direction, segment, priority, kind in io:
            link.submit(nbytes, direction, partial(landed, kind), segment, priority)

    def _pe_step_io(
        self, plans: Sequence[tuple[_Engine, Sequence[tuple[_Req, int]]]]
    ) -> list[tuple[Link, int, Direction, int, int, str]]:
        """The transfers a PE group step waits for: layer-block KV streams and the EP all-to-all."""
        io: list[tuple[Link, int, Direction, int, int, str]] = []
        layer_block = max(1, self._bytes(self.block_tokens) // self.model.num_layers)
        kv_priority = KV_PRIORITY if self.policy.traffic_isolation else MODEL_PRIORITY
        by_id = self.by_id
        other_nodes = len(self.pe_groups) - 1
        for pe, chunks in plans:
            if other_nodes and not self.zero_io:
                m = self.model
                per_token = m.hidden_size * A2A_BYTES_PER_HIDDEN * m.num_moe_layers * other_nodes
                nbytes = per_token * sum(n for _, n in chunks)
                for direction in (Direction.OUT, Direction.IN):
                    io.append((pe.cnic, nbytes, direction, nbytes, MODEL_PRIORITY, "a2a"))
            if self.zero_io:
                continue
            for r, _ in chunks:
                first = r.computed_tokens == r.hit_tokens
                context = r.computed_tokens if (self.policy.layerwise or first) else 0
                if context <= 0:
                    continue
                nbytes = self._bytes(context)
                segment = layer_block if self.policy.layerwise else self._bytes(self.block_tokens)
                io.append((pe.cnic, nbytes, Direction.IN, segment, kv_priority, "load"))
                if r.side == "de":  # DE buffer -> DE CNIC -> compute network -> PE CNIC (§4.1)
                    io.append((by_id[r.de].cnic, nbytes, Direction.OUT, segment, kv_priority, "load"))
        return io

    def _pe_step_end(
        self, group: _Group, plans: Sequence[tuple[_Engine, Sequence[tuple[_Req, int]]]], start: float
    ) -> None:
        now = self.loop.now_s
        self.metrics.steps += 1
        self.metrics.busy_s += now - start
        self.pe_busy_s += now - start
        for pe, chunks in plans:
            for r, n in chunks:
                r.computed_tokens = min(r.computed_tokens + n, r.prompt_tokens)
                if r.computed_tokens < r.prompt_tokens:
                    continue
                r.first_token_s = now
                r.generated_tokens = 1
                if r.req.arrival_s >= self.measure_from_s:
                    self.late_ttft.add(now - r.req.arrival_s)
                window = self.ttft_windows.setdefault(int(now // TTFT_WINDOW_S), [0.0, 0.0])
                window[0] += now - r.req.arrival_s
                window[1] += 1
                pe.queue.remove(r)
                self._drop(pe, r)
                self._to_de(r, pe)
        group.stepping = False
        self._pe_step(group)
        self.kick()

    # DEs ------------------------------------------------------------------------------------------

    def _to_de(self, r: _Req, pe: _Engine) -> None:
        """Prompt KV to the DE buffer (all of it on the PE path, the new tokens on the DE path),
        then the DE's H2D, both through CNICs (§4.1, §5.2)."""
        de = self.by_id[r.de]

        def arrived(_t: Transfer | None = None) -> None:
            if r.generated_tokens >= r.req.output_tokens:
                self._finish(de, r)
                return
            de.incoming.append(r)
            if not de.stepping:
                de.stepping = True
                self.loop.after(0.0, EventKind.WAKE, partial(self._de_step, de))

        if self.zero_io:
            arrived()
            return
        kv_priority = KV_PRIORITY if self.policy.traffic_isolation else MODEL_PRIORITY
        sent = r.prompt_tokens if r.side == "pe" else r.prompt_tokens - r.hit_tokens
        legs = [
            (pe.cnic, self._bytes(sent), Direction.OUT),
            (de.cnic, self._bytes(sent + r.prompt_tokens), Direction.IN),
        ]
        pending = [len(legs)]
        segment = max(1, self._bytes(self.block_tokens) // self.model.num_layers)

        def leg_done(_t: Transfer) -> None:
            pending[0] -= 1
            if pending[0] == 0:
                arrived()

        for link, nbytes, direction in legs:
            link.submit(nbytes, direction, leg_done, segment, kv_priority)

    def _de_step(self, de: _Engine) -> None:
        """Decodes every running request (§6.2) for up to DECODE_TOKENS_PER_EVENT tokens."""
        joined, de.incoming = de.incoming, []
        de.queue.extend(joined)
        if not de.queue:
            de.stepping = False
            return
        de.stepping = True
        left = min(r.req.output_tokens - r.generated_tokens for r in de.queue)
        k = max(1, min(DECODE_TOKENS_PER_EVENT, left))
        step_s = self.cost.decode_step_s(
            [r.prompt_tokens + r.generated_tokens for r in de.queue], len(self.des)
        )
        now = self.loop.now_s
        for r in joined:
            assert r.first_token_s is not None
            self.ttst.add(now + step_s - r.first_token_s)
        batch = list(de.queue)

        def end() -> None:
            self.metrics.steps += 1
            for r in batch:
                r.generated_tokens += k
                r.max_tbt_s = max(r.max_tbt_s, step_s)
                if r.generated_tokens >= r.req.output_tokens:
                    de.queue.remove(r)
                    self._finish(de, r)
            self._de_step(de)

        self.loop.after(k * step_s, EventKind.STEP_END, end)

    def _finish(self, de: _Engine, r: _Req) -> None:
        now = self.loop.now_s
        assert r.first_token_s is not None
        bt = self.block_tokens
        self.metrics.add_request(
            RequestRecord(
                arrival_s=r.req.arrival_s,
                first_token_s=r.first_token_s,
                finish_s=now,
                prompt_tokens=r.prompt_tokens,
                output_tokens=r.req.output_tokens,
                hit_tokens=(0, 0, 0, r.hit_tokens),
                max_tbt_s=r.max_tbt_s,
                matched_blocks=r.hit_tokens // bt,
                prompt_blocks=-(-r.prompt_tokens // bt),
            )
        )
        de.free_hbm_tokens += self._de_need_tokens(r)
        self._drop(de, r)
        del self.requests[r.req.req_id]
        new_tokens = r.prompt_tokens + r.req.output_tokens - r.hit_tokens
        if not self.zero_io:
            # New KV is persisted through the DE's CNIC (D2H) and storage NIC (out). Both run in the
            # lowest class on directions no read or load uses, so they delay nothing: counted, not
            # simulated (two transfers fewer per request).
            self.bytes_written += self._bytes(max(new_tokens, 0))
        for child in self._children.pop(r.req.req_id, []):
            self._next_hit[child.req_id] = (r.prompt_tokens + r.req.output_tokens) // bt * bt
            child.arrival_s = now + child.think_time_s
            self.loop.schedule(child.arrival_s, EventKind.ARRIVAL, partial(self._arrive, child, False))
        self.kick()

    # Results --------------------------------------------------------------------------------------

    def result(self) -> dict[str, Any]:
        span = max(self.loop.now_s, 1e-12)
        snics: dict[str, dict[str, float]] = {}
        for group in self.pe_groups + self.de_groups:
            link = group.engines[0].node.snic
            busy = link.busy_s()
            snics[link.name] = {
                "utilisation_in": busy[0] / span,
                "bytes_in": float(link.bytes_moved[0]),
                "bytes_out": float(link.bytes_moved[1]),
            }
        out = self.metrics.result(snics)
        reads = [v["bytes_in"] for v in snics.values()]
        mean = sum(reads) / len(reads)
        out["storage_nic_read_max_over_mean"] = max(reads) / mean if mean > 0 else 1.0
        out["ttst_s"] = self.ttst.summary()
        out["ttft_steady_s"] = self.late_ttft.summary()
        out["ttft_windows"] = [
            [k * TTFT_WINDOW_S, total / count, count]
            for k, (total, count) in sorted(self.ttft_windows.items())
        ]
        out["bytes_written"] = float(self.bytes_written)
        out["pe_busy_fraction"] = self.pe_busy_s / (span * len(self.pe_groups))
        return out


def run_dualpath(config: SimConfig, requests: Iterator[Request]) -> dict[str, Any]:
    """Runs ``config`` (a DualPath policy) on ``requests`` and returns run.run's result fields."""
    from kvtier.sched import make_policy

    wall_start = time.perf_counter()
    spec = dict(config.policy)
    policy = make_policy(str(spec.pop("name")), **spec)
    if not isinstance(policy, DualPath):
        raise ConfigError(f"policy {policy.name!r} is not a DualPath policy")
    cluster = DualPathCluster(config, policy)
    cluster.feed(requests)
    cluster.loop.run(until_s=config.max_sim_s)
    result = cluster.result()
    result.update(
        {
            "config": config.name,
            "policy": dict(config.policy),
            "hardware": cluster.hw.name,
            "model": cluster.model.name,
            "events": cluster.loop.events_run,
            "sim_time_s": cluster.loop.now_s,
            "wall_s": time.perf_counter() - wall_start,
            "unfinished_requests": len(cluster.requests) + len(cluster.waiting),
        }
    )
    return result


def is_dualpath(config: SimConfig) -> bool:
    """Whether ``config`` runs on the DualPath cluster (its policy is a DualPath policy)."""
    from kvtier.sched import make_policy

    spec = dict(config.policy)
    return isinstance(make_policy(str(spec.pop("name")), **spec), DualPath)
