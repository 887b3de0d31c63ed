"""One simulated serving engine: continuous batching over a paged device KV pool, with a prefix
index (:class:`HiRadixTree`) whose blocks live on device, host, SSD or remote tiers.

Each step the engine shows its policy a :class:`SchedulerView`, applies the decision (admissions,
chunked prefills, decodes, loads, preemptions), asks the cost model how long the batch computes,
and ends the step when both compute and any step-bound loads are done (docs/simulator.md, load
modes). Capacity is managed here, not in the tree: before a block is placed on a tier, room is
made by evicting that tier's least-recently-used unlocked blocks; evicted host blocks are written
down to SSD when there is one. A request that cannot get a device block preempts the most recently
admitted running request (vLLM's passive preemption by recompute).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.errors import SimError
from kvtier.radix import HiRadixTree, Tier
from kvtier.sched.base import (
    LoadMode,
    LoadOrder,
    Phase,
    Policy,
    RequestView,
    SchedulerView,
    SwapCopy,
)
from kvtier.sim.core import EventKind, EventLoop
from kvtier.sim.cost import BatchShape, CostModel, PrefillChunk
from kvtier.sim.events.step_end import Step, finish_step
from kvtier.sim.metrics import Metrics
from kvtier.sim.request import Request
from kvtier.sim.resources import Direction, Link, StripedLink, Transfer
from kvtier.sim.state import SimRequest

_LOWER_TIERS = (Tier.HOST, Tier.SSD, Tier.REMOTE)


@dataclass(frozen=True)
class EngineConfig:
    block_tokens: int
    device_blocks: int
    host_blocks: int = 0  # 0 = no host tier
    ssd_blocks: int = 0  # 0 = no SSD tier
    remote_blocks: int = 0  # 0 = no remote tier
    max_batch_tokens: int = 8192
    max_running: int = 256
    view_waiting_max: int = 64  # waiting requests shown to the policy (the queue's head)
    offload_priority: int = 2  # link class of write-backs: below loads (1)
    # A lower tier already holding every arriving prompt's blocks: a store filled before the run
    # (ShadowServe §6.1 pre-loads all KV into the storage server). None: tiers start empty.
    preload_tier: Tier | None = None
    # False: a finished request's blocks leave the device (vLLM with prefix caching off, as in
    # LMCache's benchmarks), so every later hit is served from the lower tiers.
    device_prefix_cache: bool = True

    def __post_init__(self) -> None:
        for name in ("block_tokens", "device_blocks", "max_batch_tokens", "max_running", "view_waiting_max"):
            if getattr(self, name) < 1:
                raise SimError(f"engine `{name}` is {getattr(self, name)}; expected >= 1")
        if self.host_blocks < 0 or self.ssd_blocks < 0 or self.remote_blocks < 0:
            raise SimError("engine host/ssd/remote blocks must be >= 0 (0 disables the tier)")


class Engine:
    """A single engine (one GPU or one TP group)."""

    def __init__(
        self,
        loop: EventLoop,
        name: str,
        config: EngineConfig,
        cost: CostModel,
        policy: Policy,
        metrics: Metrics,
        host_link: Link,
        ssd_link: Link | StripedLink | None = None,
        remote_link: Link | None = None,
        on_finish: Callable[[SimRequest], None] | None = None,
        on_prefill_done: Callable[[SimRequest], None] | None = None,
        host_store_link: Link | StripedLink | None = None,
    ) -> None:
        self.loop = loop
        # The device(s) holding the host tier (kvtier.sim.pool: one memory module, or a pool of
        # modules and SSDs): loads from host and below cross it too, and host writes go to it.
        self.host_store_link = host_store_link
        self.fetch_stall_since_s: float | None = None  # idle with async fetches in flight since
        self.name = name
        self.config = config
        self.cost = cost
        self.policy = policy
        self.metrics = metrics
        self.host_link = host_link
        self.ssd_link = ssd_link
        self.remote_link = remote_link
        # Lower tiers in order, each with its capacity and the link that reaches it from host memory.
        self.lower_tiers: dict[Tier, tuple[int, Link | StripedLink]] = {
            Tier.HOST: (config.host_blocks, host_link if host_store_link is None else host_store_link)
        }
        if config.ssd_blocks and ssd_link is not None:
            self.lower_tiers[Tier.SSD] = (config.ssd_blocks, ssd_link)
        if config.remote_blocks and remote_link is not None:
            self.lower_tiers[Tier.REMOTE] = (config.remote_blocks, remote_link)
        if not config.host_blocks:
            del self.lower_tiers[Tier.HOST]
        self.swapped: dict[int, SimRequest] = {}
        self.interference: list[float] = []  # slowdowns of the loads running now
        self.decoders: dict[float, Link] = {}
        self.swap_host_blocks = 0  # host blocks holding swapped-out requests' KV
        # Swap copies per Policy.swap_copy (SuperInfer §4.3): the FIFO of copies that run one at a
        # time (not duplex), step-synced swaps in flight, and the step (or step start) they hold.
        self.serial_swaps: deque[Callable[[], None]] = deque()
        self.serial_busy = False
        self.swap_batches: dict[Direction, list[tuple[int, Callable[[Transfer], None]]]] = {
            Direction.IN: [],
            Direction.OUT: [],
        }
        self.swap_barrier = 0
        self.held_step: Step | None = None
        self.held_start_s: float | None = None
        self.on_finish = on_finish
        self.on_prefill_done = on_prefill_done  # set for the prefill engine of a P/D pair
        self.block_bytes = config.block_tokens * cost.kv_bytes_per_token
        self.tree = HiRadixTree({Tier.DEVICE: None, Tier.HOST: None, Tier.SSD: None, Tier.REMOTE: None})
        self.requests: dict[int, SimRequest] = {}
        self.waiting: list[tuple[float, int]] = []  # (arrival_s, req_id), kept sorted
        self.running: list[SimRequest] = []
        self.fetching: dict[int, SimRequest] = {}
        self.private_blocks = 0
        self.reserved_blocks = 0
        self.stepping = False
        self._kick_pending = False
        self.incoming: deque[SimRequest] = deque()  # P/D decode engines: KV arrived, awaiting blocks
        if config.preload_tier is not None and config.preload_tier not in self.lower_tiers:
            raise SimError(
                f"engine {name!r} preloads tier {config.preload_tier.label!r}, which it does not have"
            )
        if config.host_blocks == 0 and policy.offload != "none":
            raise SimError(
                f"policy {policy.name!r} writes KV through to host, but the engine has no host tier"
            )

    # ----------------------------------------------------------------------------------------
    # Arrivals and the step loop

    def submit(self, req: Request) -> None:
        need = math.ceil((req.prompt_tokens + req.output_tokens) / self.config.block_tokens)
        if need > self.config.device_blocks:
            raise SimError(
                f"request {req.req_id} needs {need} device blocks ({req.prompt_tokens}+{req.output_tokens} "
                f"tokens); engine {self.name!r} has {self.config.device_blocks}: capacity too small"
            )
        r = SimRequest(req)
        self.requests[req.req_id] = r
        if self.config.preload_tier is not None:  # the store held this prompt before it arrived
            self._place(r.keys, self.config.preload_tier)
        self._enqueue(r)
        self.kick()

    def _enqueue(self, r: SimRequest) -> None:
        """Waiting: its blocks are marked in-queue (Strata §4.3.1 transient nodes)."""
        bisect.insort(self.waiting, (r.req.arrival_s, r.req_id))
        self.tree.mark_in_queue(r.keys, True)
        r.queue_marked = True

    def kick(self) -> None:
        """Starts a step at the current instant unless one is running (arrivals at one instant batch)."""
        if self.stepping or self._kick_pending:
            return
        self._kick_pending = True
        self.loop.after(0.0, EventKind.WAKE, self._wake)

    def _wake(self) -> None:
        self._kick_pending = False
        if not self.stepping:
            self._start_step()

    def free_device_blocks(self) -> int:
        """Device blocks not holding anything (cached blocks excluded)."""
        used = self.tree.used_blocks(Tier.DEVICE) + self.private_blocks + self.reserved_blocks
        return self.config.device_blocks - used

    def available_device_blocks(self) -> int:
        """Blocks a new allocation can get: free ones plus unlocked cached ones (evicted on demand)."""
        return self.free_device_blocks() + self.tree.evictable_blocks(Tier.DEVICE)

    def _start_step(self) -> None:
        if self.fetch_stall_since_s is not None:  # the GPU sat idle while async fetches ran
            self.metrics.fetch_stall_s += self.loop.now_s - self.fetch_stall_since_s
            self.fetch_stall_since_s = None
        if self.swap_barrier and self.policy.swap_copy.sync == "next_step":
            self.stepping, self.held_start_s = True, self.loop.now_s  # the last step's swaps land first
            return
        if self.incoming:
            self._admit_incoming()
        if self.policy.swap_copy.eager:
            self._rotate_synced_blocks()
        decision = self.policy.schedule(self._view())
        step = Step(self, start_s=self.loop.now_s)
        # Epochs before any preemption or swap: work planned for a request that leaves is dropped.
        epochs = {rid: self._get(rid, "prefill").epoch for rid, _ in decision.prefill}
        epochs.update((rid, self._get(rid, "decode").epoch) for rid in decision.decode)
        for rid in decision.preempt:
            self._preempt(self._get(rid, "preempt"))
        for rid in decision.swap_out:
            self._swap_out(self._get(rid, "swap out"))
        for rid in decision.swap_in:
            self._swap_in(self._get(rid, "swap in"))
        self._flush_swaps()
        loads = {lo.req_id: lo for lo in decision.loads}
        for rid, n in decision.prefill:
            r = self.requests[rid]
            if r.epoch == epochs[rid]:  # else preempted while this step was planned
                self._plan_prefill(step, r, n, loads.pop(rid, None))
        for rid in decision.decode:
            r = self.requests[rid]
            if r.epoch == epochs[rid]:
                self._plan_decode(step, r)
        for lo in loads.values():  # loads for requests not prefilled this step
            r = self._get(lo.req_id, "load")
            if lo.target == "host":
                self._prefetch(r, lo)
            elif lo.target == "device":
                self._start_fetch(r, lo)
            else:
                raise SimError(
                    f"policy {self.policy.name!r}: load target {lo.target!r}; expected device or host"
                )
        if step.empty():
            self.stepping = False
            if self.fetching:
                self.fetch_stall_since_s = self.loop.now_s
            busy = self.running or self.fetching or any(r.swap_pending for r in self.swapped.values())
            if not busy and self.waiting:
                self._check_not_stuck()
            return
        self.stepping = True
        shape = BatchShape(tuple(step.prefill_chunks), tuple(step.decode_contexts))
        slowdown = max([*self.interference, *(load.order.interference for load in step.loads)], default=0.0)
        step.compute_s = self.cost.step_time_s(shape) * (1.0 + slowdown)
        if self.swap_barrier and self.policy.swap_copy.sync == "step":  # compute after its swaps land
            self.held_step = step
            return
        step.begin()

    def _check_not_stuck(self) -> None:
        head = self.requests[self.waiting[0][1]]
        raise SimError(
            f"engine {self.name!r} cannot admit request {head.req_id} ({head.req.prompt_tokens} prompt tokens) "
            f"with {self.available_device_blocks()} available of {self.config.device_blocks} device blocks and nothing "
            f"running: capacity or max_batch_tokens too small for one request, or the policy never admits it"
        )

    def _get(self, rid: int, what: str) -> SimRequest:
        r = self.requests.get(rid)
        if r is None:
            raise SimError(f"policy {self.policy.name!r} asked to {what} unknown request {rid}")
        return r

    # ----------------------------------------------------------------------------------------
    # The view

    def _view(self) -> SchedulerView:
        waiting = tuple(
            self._request_view(self.requests[rid]) for _, rid in self.waiting[: self.config.view_waiting_max]
        )
        return SchedulerView(
            now_s=self.loop.now_s,
            waiting=waiting,
            running=tuple(self._request_view(r) for r in self.running),
            fetching=tuple(self._request_view(r) for r in self.fetching.values()),
            swapped=tuple(self._request_view(r) for r in self.swapped.values() if not r.swap_pending),
            free_device_blocks=self.available_device_blocks(),
            free_host_blocks=(self.config.host_blocks - self.tree.used_blocks(Tier.HOST))
            if self.config.host_blocks
            else None,
            block_tokens=self.config.block_tokens,
            max_batch_tokens=self.config.max_batch_tokens,
            max_running=self.config.max_running,
            num_layers=self.cost.num_layers,
            cost=_Estimates(self),
            kv_bytes_per_token=self.cost.kv_bytes_per_token,
        )

    def _request_view(self, r: SimRequest) -> RequestView:
        cached = (0, 0, 0, 0)
        in_queue = in_flight = 0
        if not r.admitted:
            m = self.tree.match(r.keys, own_queue_marks=int(r.queue_marked))
            bt = self.config.block_tokens
            per_tier = [0, 0, 0, 0]
            for tier in m.tiers:
                per_tier[tier] += bt
            cached = _cap_prefix(per_tier, r.req.prompt_tokens, bt)
            in_queue, in_flight = m.in_queue_blocks * bt, m.in_flight_blocks * bt
        return RequestView(
            req_id=r.req_id,
            arrival_s=r.req.arrival_s,
            phase=r.phase,
            prompt_tokens=r.req.prompt_tokens,
            computed_tokens=r.computed_tokens,
            generated_tokens=r.generated_tokens,
            cached_tokens=cached,
            in_queue_tokens=in_queue,
            in_flight_tokens=in_flight,
            block_keys=r.keys,
        )

    # ----------------------------------------------------------------------------------------
    # Planning a step

    def _admit(self, r: SimRequest) -> None:
        """Takes the device part of the cached prefix (free) and locks it."""
        m = self.tree.match(r.keys, now_s=self.loop.now_s)
        bt = self.config.block_tokens
        per_tier = [0, 0, 0, 0]
        for tier in m.tiers:
            per_tier[tier] += bt
        cached = _cap_prefix(per_tier, r.req.prompt_tokens, bt)
        if r.matched_blocks is None:
            r.matched_blocks = m.keys_matched
        device_blocks = cached[0] // bt
        device_tokens = cached[0]
        self.tree.lock(r.keys[:device_blocks])
        r.locked_blocks = device_blocks
        if r.queue_marked:
            self.tree.mark_in_queue(r.keys, False)
            r.queue_marked = False
        if device_blocks < len(r.keys):  # the rest is in flight: loaded or computed from now on
            self.tree.mark_in_flight(r.keys, True, start=device_blocks)
            r.flight_marked = True
        r.computed_tokens = device_tokens
        r.hit_tokens[0] = device_tokens
        r.admitted = True
        del self.waiting[self._waiting_index(r)]
        r.phase = Phase.RUNNING
        self.running.append(r)

    def _waiting_index(self, r: SimRequest) -> int:
        i = bisect.bisect_left(self.waiting, (r.req.arrival_s, r.req_id))
        if i >= len(self.waiting) or self.waiting[i][1] != r.req_id:
            raise SimError(f"request {r.req_id} is not waiting")
        return i

    def _plan_prefill(self, step: Step, r: SimRequest, n: int, load: LoadOrder | None) -> None:
        if r.phase is Phase.FETCHING:
            raise SimError(f"policy {self.policy.name!r} scheduled fetching request {r.req_id}")
        if not r.admitted:
            self._admit(r)
            if load is not None and load.mode is LoadMode.ASYNC:
                self._start_fetch(r, load)
                return
        loaded = 0
        if load is not None:
            loaded = self._plan_step_load(step, r, load)
        n = min(n, r.req.prompt_tokens - r.computed_tokens - loaded)
        if n <= 0 and loaded == 0:
            return
        if not self._allocate(r, r.computed_tokens + loaded + n, exclude=r):
            return
        step.add_prefill(r, n, PrefillChunk(n, r.computed_tokens + loaded))

    def _plan_decode(self, step: Step, r: SimRequest) -> None:
        if not r.prefill_done or r.phase is not Phase.RUNNING:
            raise SimError(
                f"policy {self.policy.name!r} asked to decode request {r.req_id} before its prefill"
            )
        if not self._allocate(r, r.req.prompt_tokens + r.generated_tokens + 1, exclude=r):
            return
        step.add_decode(r, r.req.prompt_tokens + r.generated_tokens)

    def _allocate(self, r: SimRequest, tokens_on_device: int, exclude: SimRequest) -> bool:
        """Grows ``r``'s private blocks to cover ``tokens_on_device``; preempts others if needed."""
        need = math.ceil(tokens_on_device / self.config.block_tokens) - r.locked_blocks - r.private_blocks
        need -= r.reserved_blocks
        if need <= 0:
            return True
        while not self._make_room(need):
            victim = next((v for v in reversed(self.running) if v is not exclude), None)
            if victim is None:
                return False
            self._preempt(victim)
        r.private_blocks += need
        self.private_blocks += need
        return True

    def _make_room(self, blocks: int) -> bool:
        short = blocks - self.free_device_blocks()
        if short > 0:
            if self.policy.offload == "write_back" and Tier.HOST in self.lower_tiers:
                # Evicted device blocks are copied down to host (their KV lives on below).
                self._make_room_below(Tier.HOST, short)
                demoted = self.tree.evict(Tier.DEVICE, short, demote_to=Tier.HOST)
                self._offload_bytes(Tier.HOST, len(demoted))
            else:
                self.tree.evict(Tier.DEVICE, short)
        return self.free_device_blocks() >= blocks

    def _tier_capacity(self, tier: Tier) -> int:
        capacity = self.lower_tiers[tier][0]
        return capacity - self.swap_host_blocks if tier is Tier.HOST else capacity

    def _next_lower(self, tier: Tier) -> Tier | None:
        return next((t for t in self.lower_tiers if t > tier), None)

    def _make_room_below(self, tier: Tier, blocks: int) -> None:
        """Frees ``blocks`` in a lower tier. Write-back demotes its LRU blocks to the next tier
        down; under write-through the lower tiers already hold copies, so they are dropped."""
        short = blocks - (self._tier_capacity(tier) - self.tree.used_blocks(tier))
        if short <= 0:
            return
        lower = self._next_lower(tier) if self.policy.offload == "write_back" else None
        if lower is None:
            self.tree.evict(tier, short)
            return
        self._make_room_below(lower, short)
        demoted = self.tree.evict(tier, short, demote_to=lower)
        self._offload_bytes(lower, len(demoted))

    def _offload_bytes(self, tier: Tier, blocks: int) -> None:
        """Charges the write of ``blocks`` into ``tier`` to the link that reaches it."""
        if blocks:
            link = self.lower_tiers[tier][1]
            nbytes = blocks * self.block_bytes
            link.submit(nbytes, Direction.OUT, _ignore, self.block_bytes, self.config.offload_priority)

    # ----------------------------------------------------------------------------------------
    # Loads

    def _loadable_blocks(self, r: SimRequest, tokens: int) -> list[tuple[int, Tier]]:
        """The blocks right after the device prefix that hold ``tokens`` cached tokens, with tiers."""
        m = self.tree.match(r.keys)
        start = r.locked_blocks
        blocks = math.ceil(tokens / self.config.block_tokens)
        picked = [(r.keys[i], m.tiers[i]) for i in range(start, min(start + blocks, len(m.tiers)))]
        return [(k, t) for k, t in picked if t is not Tier.DEVICE] if picked else []

    def _plan_step_load(self, step: Step, r: SimRequest, load: LoadOrder) -> int:
        tokens = min(load.tokens, r.req.prompt_tokens - 1 - r.computed_tokens)
        blocks = self._loadable_blocks(r, tokens)
        if not blocks:
            return 0
        tokens = min(tokens, len(blocks) * self.config.block_tokens)
        if not self._reserve(r, len(blocks)):
            return 0
        step.add_load(r, load, blocks, tokens)
        return tokens

    def _reserve(self, r: SimRequest, blocks: int) -> bool:
        if not self._make_room(blocks):
            return False
        r.reserved_blocks += blocks
        self.reserved_blocks += blocks
        return True

    def start_load_transfers(
        self, load: LoadOrder, blocks: list[tuple[int, Tier]], done: Callable[[], None]
    ) -> None:
        """Moves ``blocks`` to the device (or host, for a prefetch), each from its tier; ``done``
        runs when all have landed.

        Blocks below host cross two or more stages — the SSD or remote link, the decoder of a
        compressed fetch, the host link — modelled as a pipeline (Unified KV pooling §IV,
        ShadowServe §4.2): every stage runs concurrently on its own resource, so the slowest sets
        the time, and concurrent fetches share each stage.
        """
        by_tier: dict[Tier, int] = {}
        for _, tier in blocks:
            by_tier[tier] = by_tier.get(tier, 0) + 1
        segment = self._segment_bytes(load)
        to_device = load.target == "device"
        legs: list[tuple[Link | StripedLink, int, int]] = []
        for tier, count in by_tier.items():
            raw = count * self.block_bytes
            packed = max(1, int(raw / load.compression_ratio))
            if tier in (Tier.SSD, Tier.REMOTE) and tier in self.lower_tiers:
                legs.append((self.lower_tiers[tier][1], packed, self.block_bytes))
                if load.decode_bytes_per_s is not None:
                    legs.append((self._decoder(load.decode_bytes_per_s), raw, self.block_bytes))
            if to_device:
                host_bytes = packed if load.decode_on_device else raw
                legs.append((self.host_link, host_bytes, segment))
        if self.host_store_link is not None and blocks:  # read from, or staged through, host memory
            staged = max(1, int(len(blocks) * self.block_bytes / load.compression_ratio))
            legs.append((self.host_store_link, staged, self.block_bytes))
        if not legs:
            self.loop.after(0.0, EventKind.TRANSFER_DONE, done)
            return
        pending = [len(legs)]
        if load.interference > 0:
            self.interference.append(load.interference)

        def leg_done(_t: Transfer) -> None:
            pending[0] -= 1
            if pending[0] == 0:
                if load.interference > 0:
                    self.interference.remove(load.interference)
                done()

        for link, nbytes, seg in legs:
            link.submit(nbytes, Direction.IN, leg_done, seg, load.priority)

    def _decoder(self, bytes_per_s: float) -> Link:
        """The engine's decompression stage (SmartNIC or host cores), one per throughput setting."""
        link = self.decoders.get(bytes_per_s)
        if link is None:
            link = Link(self.loop, f"{self.name}.decoder", bytes_per_s, bytes_per_s)
            self.decoders[bytes_per_s] = link
        return link

    def _prefetch(self, r: SimRequest, load: LoadOrder) -> None:
        """Brings a waiting request's SSD/remote blocks up into host memory (no device blocks)."""
        if r.admitted or r.prefetching:
            return
        m = self.tree.match(r.keys)
        bt = self.config.block_tokens
        limit = min(len(m.tiers), math.ceil(load.tokens / bt) + m.prefix_in(Tier.HOST))
        blocks = [(r.keys[i], m.tiers[i]) for i in range(limit) if m.tiers[i] in (Tier.SSD, Tier.REMOTE)]
        if not blocks or Tier.HOST not in self.lower_tiers:
            return
        r.prefetching = True
        path = r.keys[:limit]

        def landed() -> None:
            r.prefetching = False
            self._place(path, Tier.HOST)
            self.kick()

        self.start_load_transfers(load, blocks, landed)

    def _segment_bytes(self, load: LoadOrder) -> int:
        per_token_layer = self.cost.kv_bytes_per_token / self.cost.num_layers
        if load.segment_tokens is not None:  # per page, per layer, K and V separately
            return max(1, int(load.segment_tokens * per_token_layer / 2))
        if load.mode is LoadMode.LAYERWISE:  # one layer of one block
            return max(1, int(self.config.block_tokens * per_token_layer))
        return self.block_bytes

    def land_load(self, r: SimRequest, start_block: int, blocks: list[tuple[int, Tier]], epoch: int) -> bool:
        """Loaded blocks become device-resident, locked for ``r``; their reservation is released.

        Returns False if ``r`` was preempted meanwhile: the blocks are then cached, unlocked.
        """
        end = start_block + len(blocks)
        path = r.keys[:end]
        if epoch != r.epoch:  # preempted meanwhile: its reservation is gone; the bytes are dropped
            return False
        assert r.locked_blocks == start_block, "a request's lock grew while its load was in flight"
        self.tree.insert(path, Tier.DEVICE, self.loop.now_s)
        self._extend_lock(r, end)
        r.reserved_blocks -= len(blocks)
        self.reserved_blocks -= len(blocks)
        for _, tier in blocks:
            r.hit_tokens[tier] += self.config.block_tokens
        return True

    def _start_fetch(self, r: SimRequest, load: LoadOrder) -> None:
        """An asynchronous fetch: the request leaves the batch until its prefix has landed."""
        if not r.admitted:
            self._admit(r)
        tokens = min(load.tokens, r.req.prompt_tokens - 1 - r.computed_tokens)
        blocks = self._loadable_blocks(r, tokens)
        if not blocks or not self._reserve(r, len(blocks)):
            return
        self.running.remove(r)
        r.phase = Phase.FETCHING
        self.fetching[r.req_id] = r
        start, epoch = r.locked_blocks, r.epoch
        tokens = min(tokens, len(blocks) * self.config.block_tokens)

        def landed() -> None:
            if not self.land_load(r, start, blocks, epoch):
                return
            r.computed_tokens = min(r.computed_tokens + tokens, r.req.prompt_tokens - 1)
            del self.fetching[r.req_id]
            r.phase = Phase.RUNNING
            self.running.append(r)
            self.kick()

        self.start_load_transfers(load, blocks, landed)

    # ----------------------------------------------------------------------------------------
    # Completion, offload, preemption

    def commit_prefix(self, r: SimRequest) -> None:
        """Puts ``r``'s newly computed prompt blocks in the prefix index (device), locked."""
        bt = self.config.block_tokens
        full = len(r.keys) if r.prefill_done else r.computed_tokens // bt
        start = r.locked_blocks
        if full <= start:
            return
        path = r.keys[:full]
        self.tree.insert(path, Tier.DEVICE, self.loop.now_s)
        self._extend_lock(r, full)
        moved = min(full - start, r.private_blocks)
        r.private_blocks -= moved
        self.private_blocks -= moved
        if self.policy.offload == "write_through":
            self._write_through(path, full - start)

    def _write_through(self, path: tuple[int, ...], new_blocks: int) -> None:
        """Copies the ``new_blocks`` last blocks of ``path`` to every lower tier (LMCache stores to
        all its backends; HiCache backs up to host and storage); each tier holds them once landed."""
        nbytes = new_blocks * self.block_bytes
        for tier, (_, link) in self.lower_tiers.items():

            def stored(_t: Transfer, tier: Tier = tier) -> None:
                self._place(path, tier)

            link.submit(nbytes, Direction.OUT, stored, self.block_bytes, self.config.offload_priority)

    def _place(self, path: tuple[int, ...], tier: Tier) -> None:
        """Makes the longest prefix of ``path`` that the tier can hold resident there."""
        keep = min(len(path), self._tier_capacity(tier))
        if keep <= 0:
            return
        self._make_room_below(tier, keep)
        if self._tier_capacity(tier) - self.tree.used_blocks(tier) >= keep:  # else all of it is locked
            self.tree.insert(path[:keep], tier, self.loop.now_s)

    def _extend_lock(self, r: SimRequest, end: int) -> None:
        """``r`` now holds ``keys[:end]`` on device: lock the new blocks, clear their in-flight mark."""
        start = r.locked_blocks
        path = r.keys[:end]
        self.tree.lock(path, start=start)
        if r.flight_marked:
            self.tree.mark_in_flight(path, False, start=start)
            r.flight_marked = end < len(r.keys)
        r.locked_blocks = end

    def release(self, r: SimRequest) -> None:
        """Drops ``r``'s hold on device blocks (its prefix stays cached, unlocked)."""
        if r.flight_marked:
            self.tree.mark_in_flight(r.keys, False, start=r.locked_blocks)
            r.flight_marked = False
        self.tree.unlock(r.keys[: r.locked_blocks])
        r.locked_blocks = 0
        self.private_blocks -= r.private_blocks
        r.private_blocks = 0
        self.reserved_blocks -= r.reserved_blocks
        r.reserved_blocks = 0

    def _preempt(self, r: SimRequest) -> None:
        if r.phase is not Phase.RUNNING:
            raise SimError(f"cannot preempt request {r.req_id} in phase {r.phase.value}")
        self.release(r)
        self.running.remove(r)
        r.phase = Phase.WAITING
        r.admitted = False
        r.preempted = True
        r.epoch += 1
        r.hit_tokens = [0, 0, 0, 0]  # counted again when it is admitted again
        r.computed_tokens = 0
        r.pending_load_tokens = 0
        r.host_copied_blocks = r.host_synced_blocks = 0  # its eager host copies go with its KV
        self._enqueue(r)
        self.metrics.preemptions += 1

    def finish(self, r: SimRequest) -> None:
        freed = r.private_blocks
        self.release(r)
        if not self.config.device_prefix_cache:  # no GPU prefix cache: unlocked blocks leave
            self.tree.evict(Tier.DEVICE, self.tree.evictable_blocks(Tier.DEVICE))
        elif r.req.finish_keys:
            # The reply's full blocks were private (decode tokens, the prompt's partial tail); like a
            # real engine's prefix cache, keep them cached under the whole sequence's keys.
            prompt_full = r.req.prompt_tokens // self.config.block_tokens
            keep = min(len(r.req.finish_keys), prompt_full + freed)
            if keep > prompt_full and self.free_device_blocks() >= keep - prompt_full:
                self.tree.insert(r.req.finish_keys[:keep], Tier.DEVICE, self.loop.now_s)
        self.running.remove(r)
        del self.requests[r.req_id]
        if self.on_finish is not None:
            self.on_finish(r)

    # ----------------------------------------------------------------------------------------
    # Swap (preemption that keeps the KV, in host memory)

    def _swap_out(self, r: SimRequest) -> None:
        """Moves a running request's KV to host; its device blocks free when the copy has landed."""
        if r.phase is not Phase.RUNNING:
            raise SimError(
                f"policy {self.policy.name!r} swaps out request {r.req_id} in phase {r.phase.value}"
            )
        if Tier.HOST not in self.lower_tiers:
            raise SimError(
                f"policy {self.policy.name!r} swaps out, but engine {self.name!r} has no host tier"
            )
        blocks = math.ceil((r.computed_tokens + r.generated_tokens) / self.config.block_tokens)
        self._make_room_below(Tier.HOST, blocks)
        if self._tier_capacity(Tier.HOST) - self.tree.used_blocks(Tier.HOST) < blocks:
            self._preempt(r)  # host cannot hold it: fall back to recompute
            return
        self.swap_host_blocks += blocks
        r.swapped_blocks = blocks
        self.running.remove(r)
        r.phase = Phase.SWAPPED
        r.epoch += 1
        r.swap_pending = True
        self.swapped[r.req_id] = r
        copy = self.policy.swap_copy
        # min(): an eager copy issued before a recompute preemption may land after it.
        moved = blocks - min(r.host_synced_blocks, blocks) if copy.eager else blocks
        if copy.eager or copy.sync == "step":
            # Eager rotation: synced blocks have a host copy, so only the dirty tail stays held until
            # it lands (SuperInfer §4.3.2). sync "step": the copy runs before the step writes HBM.
            self.release(r)
            hold = 0 if copy.sync == "step" else moved
            r.private_blocks = hold
            self.private_blocks += hold
        if copy.sync != "none":
            self.swap_barrier += 1

        def landed(_t: Transfer) -> None:
            self.release(r)
            r.swap_pending = False
            r.host_copied_blocks = r.host_synced_blocks = (
                r.computed_tokens + r.generated_tokens
            ) // self.config.block_tokens
            self._swap_landed(copy)
            self.kick()

        self._submit_swap(moved * self.block_bytes, Direction.OUT, landed)

    def _swap_in(self, r: SimRequest) -> None:
        if r.phase is not Phase.SWAPPED or r.swap_pending:
            raise SimError(
                f"policy {self.policy.name!r} swaps in request {r.req_id}, which is not swapped out"
            )
        blocks = r.swapped_blocks
        if not self._make_room(blocks):
            return  # not now: the policy will ask again
        r.private_blocks += blocks
        self.private_blocks += blocks
        r.swap_pending = True
        copy = self.policy.swap_copy
        if copy.sync != "none":
            self.swap_barrier += 1

        def landed(_t: Transfer) -> None:
            self.swap_host_blocks -= r.swapped_blocks
            r.swapped_blocks = 0
            r.swap_pending = False
            del self.swapped[r.req_id]
            r.phase = Phase.RUNNING
            self.running.append(r)
            self._swap_landed(copy)
            self.kick()

        self._submit_swap(blocks * self.block_bytes, Direction.IN, landed)

    def _submit_swap(self, nbytes: int, direction: Direction, landed: Callable[[Transfer], None]) -> None:
        """Batched or step-synced swaps leave as one copy per direction per step (cudaMemcpyBatchAsync;
        vLLM's swap_blocks), see :meth:`_flush_swaps`; others one per request."""
        copy = self.policy.swap_copy
        if copy.batched or copy.sync != "none":
            self.swap_batches[direction].append((nbytes, landed))
        else:
            self._send_swap(nbytes, direction, landed)

    def _flush_swaps(self) -> None:
        for direction in (Direction.OUT, Direction.IN):
            batch, self.swap_batches[direction] = self.swap_batches[direction], []
            if batch:

                def landed(t: Transfer, batch: list[tuple[int, Callable[[Transfer], None]]] = batch) -> None:
                    for _, done in batch:
                        done(t)

                self._send_swap(sum(n for n, _ in batch), direction, landed)

    def _send_swap(self, nbytes: int, direction: Direction, landed: Callable[[Transfer], None]) -> None:
        segment = self._swap_segment_bytes(nbytes)
        if self.policy.swap_copy.duplex:
            self.host_link.submit(nbytes, direction, landed, segment, priority=1)
            return

        def start() -> None:  # one copy at a time, FIFO: a swap-in may reuse blocks a swap-out frees
            def done(t: Transfer) -> None:
                landed(t)
                self._next_serial_swap()

            self.host_link.submit(nbytes, direction, done, segment, priority=1)

        self.serial_swaps.append(start)
        if not self.serial_busy:
            self._next_serial_swap()

    def _next_serial_swap(self) -> None:
        """Starts the next queued swap copy (SwapCopy.duplex False: SuperInfer §4.3.2, Fig. 13 left)."""
        self.serial_busy = bool(self.serial_swaps)
        if self.serial_swaps:
            self.serial_swaps.popleft()()

    def _swap_segment_bytes(self, nbytes: int) -> int:
        """Bytes per copy launch of a swap (SuperInfer §4.3.1, :meth:`SwapCopy.segment_bytes`)."""
        return self.policy.swap_copy.segment_bytes(nbytes, self.block_bytes, self.cost.num_layers)

    def _swap_landed(self, copy: SwapCopy) -> None:
        """A step-synced swap landed: once all have, the held step computes (sync "step") or the
        held next step starts (sync "next_step"); the wait is blocked I/O."""
        if copy.sync == "none":
            return
        self.swap_barrier -= 1
        if self.swap_barrier:
            return
        now = self.loop.now_s
        if self.held_step is not None:
            step, self.held_step = self.held_step, None
            self.metrics.blocked_io_s += now - step.start_s
            step.begin()
        elif self.held_start_s is not None:
            self.metrics.blocked_io_s += now - self.held_start_s
            self.held_start_s, self.stepping = None, False
            self._start_step()

    def _rotate_synced_blocks(self) -> None:
        """Eager block rotation (SuperInfer §4.3.2): blocks filled since the last step take no more
        writes, so their host copy starts now, in the background (below swaps on the link). Their
        host space is not charged (at most the device's KV); a swap-out then moves the dirty tail."""
        bt = self.config.block_tokens
        newly: list[tuple[SimRequest, int]] = []
        blocks = 0
        for r in self.running:
            full = (r.computed_tokens + r.generated_tokens) // bt
            if full > r.host_copied_blocks:
                blocks += full - r.host_copied_blocks
                r.host_copied_blocks = full
                newly.append((r, full))
        if not newly:
            return

        def synced(_t: Transfer) -> None:
            for r, full in newly:
                r.host_synced_blocks = max(r.host_synced_blocks, full)

        nbytes = blocks * self.block_bytes
        segment = self._swap_segment_bytes(nbytes)
        self.host_link.submit(nbytes, Direction.OUT, synced, segment, self.config.offload_priority)

    def hand_off(self, r: SimRequest) -> None:
        """P/D: the request leaves this (prefill) engine; its prompt stays cached here."""
        self.release(r)
        self.running.remove(r)
        del self.requests[r.req_id]

    def accept_decode(self, r: SimRequest) -> None:
        """P/D: a request whose KV just arrived joins the decode queue of this engine."""
        r.locked_blocks = r.private_blocks = r.reserved_blocks = 0
        r.computed_tokens = r.req.prompt_tokens
        self.requests[r.req_id] = r
        self.incoming.append(r)
        self.kick()

    def _admit_incoming(self) -> None:
        while self.incoming:
            r = self.incoming[0]
            need = math.ceil((r.req.prompt_tokens + r.generated_tokens) / self.config.block_tokens)
            if not self._make_room(need):  # never preempts: running decodes keep their blocks
                return
            r.private_blocks = need
            self.private_blocks += need
            self.incoming.popleft()
            r.phase = Phase.RUNNING
            self.running.append(r)

    def end_step(self, step: Step) -> None:
        finish_step(self, step)
        self.stepping = False
        self._start_step()


def _ignore(_t: Transfer) -> None:
    return None


def _cap_prefix(per_tier: list[int], prompt_tokens: int, block_tokens: int) -> tuple[int, int, int, int]:
    """Caps a cached prefix (tokens per tier, fastest first) at the whole blocks before the last
    prompt token: at least one token is computed, and KV is reused in whole blocks."""
    left = (prompt_tokens - 1) // block_tokens * block_tokens
    out = []
    for t in per_tier:
        take = min(t, max(left, 0))
        out.append(take)
        left -= take
    return (out[0], out[1], out[2], out[3])


class _Estimates:
    """Cost estimates offered to policies (no simulator objects leak through)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        return self._engine.cost.prefill_time_s(new_tokens, context_tokens)

    def load_s(self, tokens: int, tier: str, mode: LoadMode, segment_tokens: int | None) -> float:
        e = self._engine
        blocks = math.ceil(tokens / e.config.block_tokens)
        nbytes = blocks * e.block_bytes
        order = LoadOrder(-1, tokens, mode, segment_tokens)
        seconds = e.host_link.work_s(nbytes, e._segment_bytes(order), Direction.IN)
        lower = {"ssd": Tier.SSD, "remote": Tier.REMOTE}.get(tier)
        if lower is not None and lower in e.lower_tiers:
            seconds = max(seconds, e.lower_tiers[lower][1].work_s(nbytes, e.block_bytes, Direction.IN))
        if e.host_store_link is not None and tier != "device":
            seconds = max(seconds, e.host_store_link.work_s(nbytes, e.block_bytes, Direction.IN))
        return seconds
