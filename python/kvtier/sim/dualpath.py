"""A DualPath cluster (DualPath §4-§6): PE and DE groups, two KV read paths, traffic isolation.

Built by :func:`kvtier.sim.run.build` when the global scheduler needs node groups (the policy
``dualpath``, ``dualpath_basic`` or ``dualpath_oracle`` names
:class:`~kvtier.sched.dualpath.DualPathScheduler`). The cluster's shape (PE and DE groups, one per
node; storage NICs with their disk read queues; a compute NIC per GPU) is its
:class:`~kvtier.sim.topology.Topology`; which engines serve a request, and which side its stored KV
is read to, is the global scheduler's (:class:`~kvtier.sched.placement.GlobalScheduler`); arrivals
(:class:`~kvtier.sim.arrivals.Arrivals`) and metrics (:class:`~kvtier.sim.metrics.Metrics`) are
the ones every cluster uses. What is left here is the mechanism of the two engine kinds:

- **PE groups** step in lockstep (DP attention + EP FFN, §6.2): each PE's batch is its policy's
  decision (compute quota, binary-search chunking) carried out by the decision executor
  (:func:`kvtier.sched.executor.execute`) with the PE as backend; a group step computes the
  slowest PE's attention, the group's FFN (its tokens' linear FLOPs spread evenly over its GPUs),
  and waits for its EP all-to-all on every CNIC. Layerwise prefill: a batch's context KV streams
  in during the step, which ends at ``max(compute end, last KV landed + one layer)``; without it
  (Basic), the batch's KV must fit in HBM and the step computes after its load. Streams move
  *layer blocks* (one layer of a block, App. A.5); storage objects are *full blocks*.
- **The P/D hand-off** (§4.1, §5.2): prompt KV to the DE buffer (all of it on the PE path, the new
  tokens on the DE path), then the DE's H2D, both through CNICs.
- **DEs** decode every running request each step (§6.2). To keep the event count low a DE advances
  its batch :data:`DECODE_TOKENS_PER_EVENT` tokens per event (less if a request finishes sooner);
  a request whose KV lands mid-run joins at the next event. On finishing, the request's new KV
  (append + generated tokens) is written to storage.
- **Traffic isolation** (§5.1): the EP all-to-all runs in priority class 0, KV transfers in class 1
  (the bandwidth the collectives leave). The sim config's ``network: {traffic_isolation: false}``
  (deployment config, not the policy's) puts KV in class 0.

Requests: an agent's turn has its previous turn's whole blocks in storage (DualPath App. A.4:
hits only within a trajectory, no eviction); the rest is computed. TTFT is the PE's first token,
TTST the DE's first decode step.

Modelling gaps (docs/papers/dualpath.md): DRAM and PCIe are not separate resources (the paper's
§4.2 shows they are not bottlenecks at these P/D ratios); the EP all-to-all is one transfer per
step at the step's start (not per layer); the storage backend never limits a NIC; decode
collectives are not modelled.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial

from kvtier.errors import SimError
from kvtier.sched.data_plane import default_engine
from kvtier.sched.dualpath import DualPath, DualPathScheduler
from kvtier.sched.kv_io import kv_io
from kvtier.sched.placement import EngineLoad, PendingRequest, Placement, Role
from kvtier.sim.arrivals import Arrivals
from kvtier.sim.config import SimConfig
from kvtier.sim.core import EventKind, EventLoop
from kvtier.sim.cost import STEP_OVERHEAD_S
from kvtier.sim.ep_cost import EpCost, PrefillEstimates
from kvtier.sim.gpu_engine import GpuEngine, GroupRequest, ViewShape
from kvtier.sim.hardware import load_hardware
from kvtier.sim.metrics import Metrics, RequestRecord, SimMetrics
from kvtier.sim.models import load_model
from kvtier.sim.request import Request
from kvtier.sim.resources import Direction, Link, Transfer
from kvtier.sim.topology import Topology
from kvtier.tiers import PerTier

TTFT_WINDOW_S = 150.0  # §7.4: the steady-state test's sliding window
DECODE_TOKENS_PER_EVENT = 16  # decode tokens a DE advances per simulated event (see the module docs)
MODEL_PRIORITY = 0  # §5.1: inference collectives in the high-priority virtual lane
KV_PRIORITY = 1  # §5.1: KV traffic in the low-priority lane
ACTIVATION_RESERVE_BYTES = 4 * 2**30  # as kvtier.sim.run: activations and CUDA context
# EP all-to-all bytes per token and MoE layer: an FP8 dispatch (1 byte per hidden value) and a bf16
# combine (2 bytes), DeepEP's normal kernels; a token crosses to each other node once (§7.1 DeepEP).
A2A_BYTES_PER_HIDDEN = 3


@dataclass(eq=False)
class _PeGroup:
    engines: list[GpuEngine]
    stepping: bool = False


class DualPathCluster:
    """PE/DE groups on a :class:`Topology`, driven by a :class:`DualPathScheduler` (§6.1)."""

    def __init__(self, config: SimConfig, policy: DualPath) -> None:
        self.config = config
        self.policy = policy
        # The data plane: layerwise prefill, the Oracle's bypass (the config's `io` section, else
        # the policy's paper's).
        self.io = kv_io(config.io, default_engine(config.policy, "io"))
        self.zero_io = self.io.bypass
        self.kv_priority = KV_PRIORITY if config.traffic_isolation else MODEL_PRIORITY  # §5.1
        self.hw = load_hardware(config.hardware)
        self.model = load_model(config.model)
        self.cost = EpCost(self.hw, self.model)
        self.loop = EventLoop()
        self.metrics = Metrics(slo_ttft_s=config.slo.get("ttft_s"), slo_tpot_s=config.slo.get("tpot_s"))
        self.metrics.ttft_window_s = TTFT_WINDOW_S
        # Online runs: steady-state TTFT of requests arriving in the horizon's second half (past the
        # warm-up of agents arriving into an empty cluster), for §7.4's SLO check.
        self.metrics.measure_from_s = config.max_sim_s / 2 if config.max_sim_s is not None else 0.0
        self.block_tokens = config.block_tokens
        self.topology = Topology.from_config(config, self.hw, self.loop)
        self.links = self.topology.links
        pe_weights = self.cost.weight_bytes_per_gpu(config.prefill_engines)
        pe_hbm = self.hw.hbm_capacity_bytes * config.gpu_memory_utilization - pe_weights
        pe_hbm_blocks = max(1, int((pe_hbm - ACTIVATION_RESERVE_BYTES) // self._bytes(self.block_tokens)))
        layers = self.model.num_layers
        shape = ViewShape(
            pe_hbm_blocks * (layers if self.io.layerwise else 1),
            self.block_tokens,
            layers,
            self.cost.kv_bytes_per_token,
            PrefillEstimates(self.cost),
            self.io.layerwise,
        )
        self.requests: dict[int, GroupRequest] = {}
        self.engines = {
            role: [
                [GpuEngine(slot, role, policy, self.requests, shape) for slot in group.engines]
                for group in self.topology.groups[role]
            ]
            for role in (Role.PREFILL, Role.DECODE)
        }
        self.pe_groups = [_PeGroup(engines) for engines in self.engines[Role.PREFILL]]
        self._group_of = {e.engine_id: g for g in self.pe_groups for e in g.engines}
        self.pes = [e for group in self.pe_groups for e in group.engines]
        self.des = [e for group in self.engines[Role.DECODE] for e in group]
        self.by_id = {e.engine_id: e for e in self.pes + self.des}
        self.bytes_written = 0  # new KV persisted by DEs (full blocks, §4.1)
        weights = self.cost.weight_bytes_per_gpu(len(self.des))
        hbm = self.hw.hbm_capacity_bytes * config.gpu_memory_utilization - weights - ACTIVATION_RESERVE_BYTES
        if hbm <= 0:
            raise SimError(f"{self.model.name!r} leaves no HBM for KV on a DE of {self.hw.name!r}")
        for de in self.des:
            de.free_hbm_tokens = int(hbm // self.cost.kv_bytes_per_token)
        # §6.1 / App. A.4 thresholds in tokens: alpha s of one node's storage NIC, beta s of one GPU's
        # prefill of the workload's mean request shape (profiled in advance).
        snic = self.hw.storage_nic_bytes_per_s * self.topology.gpus_per_node
        self.scheduler = DualPathScheduler(
            policy,
            short_queue_tokens=int(policy.short_read_queue_s * snic / self.cost.kv_bytes_per_token),
            unfinished_limit_tokens=int(self._gpu_tokens_per_s() * policy.unfinished_limit_s),
        )
        self._next_hit: dict[int, int] = {}
        self.arrivals = Arrivals(self.loop, self._arrive)
        self._kick_pending = False
        self.pe_busy_s = 0.0

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

    # Arrivals and global scheduling (§6.1) --------------------------------------------------------

    def feed(self, requests: Iterator[Request]) -> None:
        self.arrivals.feed(requests)

    def _arrive(self, req: Request) -> None:
        hit = min(self._next_hit.pop(req.req_id, 0), req.prompt_tokens - 1)
        r = GroupRequest(req, hit, computed_tokens=hit)
        self.requests[req.req_id] = r
        pending = PendingRequest(req.req_id, req.prompt_tokens, hit, req.output_tokens)
        self.scheduler.arrive(pending, self)
        self.kick()

    def kick(self) -> None:
        """The global scheduler fetches within its interval (when it fetches at all)."""
        interval = self.scheduler.fetch_interval_s
        if interval is not None and not self._kick_pending:
            self._kick_pending = True
            self.loop.after(interval, EventKind.WAKE, self._fetch)

    def _fetch(self) -> None:
        self._kick_pending = False
        self.scheduler.fetch(self)

    def groups(self, role: Role) -> int:
        return len(self.engines[role])

    def loads(self, role: Role, group: int | None = None) -> list[EngineLoad]:
        groups = self.engines[role]
        chosen = range(len(groups)) if group is None else (group,)
        return [
            EngineLoad(
                e.engine_id,
                gi,
                e.unfinished_requests,
                e.unfinished_tokens,
                e.slot.node.read_queue_tokens,
                e.free_hbm_tokens,
            )
            for gi in chosen
            for e in groups[gi]
        ]

    def read_queue_tokens(self, engine_id: int) -> int:
        return self.by_id[engine_id].slot.node.read_queue_tokens

    def prefix_blocks(self, req_id: int, engine_id: int) -> int:
        return 0  # no engine caches: hit KV is read from storage (App. A.4)

    def place(self, placement: Placement) -> None:
        r = self.requests[placement.req_id]
        e = self.by_id[placement.engine_id]
        e.take(r)
        if placement.role is Role.PREFILL:
            r.pe = e.engine_id
            return
        e.free_hbm_tokens -= self._de_need_tokens(r)
        r.de = e.engine_id
        self._read(r, self.by_id[r.pe], e, placement.read_side or "pe")

    @staticmethod
    def _de_need_tokens(r: GroupRequest) -> int:
        return r.prompt_tokens + r.req.output_tokens

    # Storage reads (§4.1): into the PE's or the DE's node buffer ------------------------------------

    def _read(self, r: GroupRequest, pe: GpuEngine, de: GpuEngine, side: str) -> None:
        r.side = side

        def landed() -> None:
            pe.queue.append(r)
            self._kick_pe(pe)
            self.kick()

        if r.hit_tokens == 0 or self.zero_io:
            self.loop.after(0.0, EventKind.TRANSFER_DONE, landed)
            return
        node = pe.slot.node if side == "pe" else de.slot.node
        # Full blocks: all layers of block_tokens tokens per storage object (App. A.5).
        segment = self._bytes(self.block_tokens)
        node.read(r.hit_tokens, self._bytes(r.hit_tokens), segment, KV_PRIORITY, landed)

    # PE groups (§6.2) ---------------------------------------------------------------------------

    def _kick_pe(self, pe: GpuEngine) -> None:
        group = self._group_of[pe.engine_id]
        if not group.stepping:
            group.stepping = True
            self.loop.after(0.0, EventKind.WAKE, partial(self._pe_step, group))

    def _pe_step(self, group: _PeGroup) -> None:
        """One lockstep forward of a PE group: every PE's quota-packed batch (§6.2)."""
        plans: list[tuple[GpuEngine, list[tuple[GroupRequest, int]]]] = []
        for pe in group.engines:
            if pe.queue:  # the policy's batch, through the one decision executor
                chunks = pe.plan(self.loop.now_s).prefill
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
            if self.io.layerwise:  # the last layer computes once its KV is in
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
        self, plans: Sequence[tuple[GpuEngine, Sequence[tuple[GroupRequest, int]]]]
    ) -> list[tuple[Link, int, Direction, int, int, str]]:
        """The transfers a PE group step waits for: layer-block KV streams and the EP all-to-all."""
        io: list[tuple[Link, int, Direction, int, int, str]] = []
        layer_block = max(1, self._bytes(self.block_tokens) // self.model.num_layers)
        kv_priority = self.kv_priority
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
                context = r.computed_tokens if (self.io.layerwise or first) else 0
                if context <= 0:
                    continue
                nbytes = self._bytes(context)
                segment = layer_block if self.io.layerwise else self._bytes(self.block_tokens)
                io.append((pe.cnic, nbytes, Direction.IN, segment, kv_priority, "load"))
                if r.side == "de":  # DE buffer -> DE CNIC -> compute network -> PE CNIC (§4.1)
                    io.append((by_id[r.de].cnic, nbytes, Direction.OUT, segment, kv_priority, "load"))
        return io

    def _pe_step_end(
        self,
        group: _PeGroup,
        plans: Sequence[tuple[GpuEngine, Sequence[tuple[GroupRequest, int]]]],
        start: float,
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
                self.metrics.first_token(r.req.arrival_s, now)
                pe.queue.remove(r)
                pe.drop(r)
                self._to_de(r, pe)
        group.stepping = False
        self._pe_step(group)
        self.kick()

    # DEs ------------------------------------------------------------------------------------------

    def _to_de(self, r: GroupRequest, pe: GpuEngine) -> None:
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
        kv_priority = self.kv_priority
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

    def _de_step(self, de: GpuEngine) -> None:
        """Decodes every running request (§6.2) for up to DECODE_TOKENS_PER_EVENT tokens."""
        joined, de.incoming = de.incoming, []
        de.queue.extend(joined)
        now = self.loop.now_s
        batch = de.plan(now).decode if de.queue else []  # the policy's batch, through the executor
        if not batch:
            de.stepping = False
            return
        de.stepping = True
        left = min(r.req.output_tokens - r.generated_tokens for r in batch)
        k = max(1, min(DECODE_TOKENS_PER_EVENT, left))
        step_s = self.cost.decode_step_s([r.prompt_tokens + r.generated_tokens for r in batch], len(self.des))
        for r in joined:
            assert r.first_token_s is not None
            self.metrics.ttst_s.add(now + step_s - r.first_token_s)

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

    def _finish(self, de: GpuEngine, r: GroupRequest) -> None:
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
                hit_tokens=PerTier(remote=r.hit_tokens),
                max_tbt_s=r.max_tbt_s,
                matched_blocks=r.hit_tokens // bt,
                prompt_blocks=-(-r.prompt_tokens // bt),
            )
        )
        de.free_hbm_tokens += self._de_need_tokens(r)
        de.drop(r)
        del self.requests[r.req.req_id]
        new_tokens = r.prompt_tokens + r.req.output_tokens - r.hit_tokens
        if not self.zero_io:
            # New KV is persisted through the DE's CNIC (D2H) and storage NIC (out). Both run in the
            # lowest class on directions no read or load uses, so they delay nothing: counted, not
            # simulated (two transfers fewer per request).
            self.bytes_written += self._bytes(max(new_tokens, 0))
        for child in self.arrivals.children(r.req.req_id):
            self._next_hit[child.req_id] = (r.prompt_tokens + r.req.output_tokens) // bt * bt
            self.arrivals.follow(child, now)
        self.kick()

    # Results --------------------------------------------------------------------------------------

    def unfinished_requests(self) -> int:
        return len(self.requests) + self.scheduler.pending()

    def result(self) -> SimMetrics:
        span = max(self.loop.now_s, 1e-12)
        snics: dict[str, dict[str, float]] = {}
        for link in self.topology.storage_nics():
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
        out["bytes_written"] = float(self.bytes_written)
        out["pe_busy_fraction"] = self.pe_busy_s / (span * len(self.pe_groups))
        return out
