"""One simulated serving engine: continuous batching over a paged device KV pool, with a prefix
index (:class:`HiRadixTree`) whose blocks live on device, host, SSD or remote tiers.

Each step the engine shows its policy a :class:`SchedulerView` (:mod:`kvtier.sim.view`), hands the
decision to the decision executor (:mod:`kvtier.sched.executor`, shared with the reference engine:
it keeps the order and the validation, this engine is one of its backends), asks the cost model how
long the batch computes, and ends the step when both compute and any step-bound loads are done
(docs/simulator.md, load modes). A request that cannot get a device block preempts the most
recently admitted running request (vLLM's passive preemption by recompute).

This module holds admission, planning, completion and the P/D hand-off; the other seams are their own
modules: the tiers below the device (:mod:`kvtier.sim.tiers`), the paths loads take (:mod:`kvtier.sim.loads`),
swap (:mod:`kvtier.sim.swap`) and the end of a step (:mod:`kvtier.sim.events.step_end`).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.errors import SimError
from kvtier.radix import HiRadixTree
from kvtier.sched.base import LoadMode, LoadOrder, Phase, Policy, SchedulerView
from kvtier.sched.data_plane import default_offload, policy_spec
from kvtier.sched.executor import execute
from kvtier.sched.fetch_path import PLAIN_FETCH, FetchPath
from kvtier.sched.load_path import PLAIN_LOAD, LoadPath
from kvtier.sched.swap_copy import PLAIN_SWAP, SwapCopy
from kvtier.sim.core import EventKind, EventLoop
from kvtier.sim.cost import BatchShape, CostModel, PrefillChunk, engine_kv_bytes_per_token
from kvtier.sim.events.step_end import Step, finish_step
from kvtier.sim.fast_forward import arm, next_step
from kvtier.sim.loads import LoadOrders, LoadPaths
from kvtier.sim.metrics import Metrics
from kvtier.sim.request import Request
from kvtier.sim.resources import Link, StripedLink
from kvtier.sim.state import SimRequest
from kvtier.sim.swap import Swaps
from kvtier.sim.tiers import LowerTiers
from kvtier.sim.view import SwappedViews, WaitingViews, build_view, cap_prefix, forget_waiting_view
from kvtier.tiers import Tier


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
    swap_copy: SwapCopy = PLAIN_SWAP  # how swaps cross the host link (the sim config's `swap` section)
    fetch: FetchPath = PLAIN_FETCH  # how compressed loads reach the device (the sim config's `fetch` section)
    load: LoadPath = PLAIN_LOAD  # the copies loads cross the host link in (the sim config's `load` section)
    # What the engine keeps below the device (the sim config's `offload` section): none |
    # write_through | write_back. None: its policy's paper's engine's (data_plane.default_offload).
    offload: str | None = None
    tp: int = 1  # GPUs the engine spans: its blocks below the device are tp GPUs' bytes (cost.py)

    def __post_init__(self) -> None:
        for name in ("block_tokens", "device_blocks", "max_batch_tokens", "max_running", "view_waiting_max"):
            if getattr(self, name) < 1:
                raise SimError(f"engine `{name}` is {getattr(self, name)}; expected >= 1")
        if self.host_blocks < 0 or self.ssd_blocks < 0 or self.remote_blocks < 0:
            raise SimError("engine host/ssd/remote blocks must be >= 0 (0 disables the tier)")
        if self.tp < 1:
            raise SimError(f"engine `tp` is {self.tp}; expected >= 1")


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
        self.block_tokens = config.block_tokens  # read once per decode per step
        self.cost = cost
        self.policy = policy
        # What this engine keeps below the device: its config's, else its policy's paper's.
        self.offload = config.offload or default_offload(policy_spec(policy))
        self.metrics = metrics
        self.host_link = host_link
        self.ssd_link = ssd_link
        self.remote_link = remote_link
        self.block_bytes = config.block_tokens * engine_kv_bytes_per_token(cost, config.tp)  # all GPUs'
        # Lower tiers in order, each with its capacity and the link that reaches it from host memory.
        host = host_link if host_store_link is None else host_store_link
        tiers: dict[Tier, tuple[int, Link | StripedLink]] = {Tier.HOST: (config.host_blocks, host)}
        if ssd_link is not None:
            tiers[Tier.SSD] = (config.ssd_blocks, ssd_link)
        if remote_link is not None:
            tiers[Tier.REMOTE] = (config.remote_blocks, remote_link)
        self.lower_tiers = LowerTiers(self, tiers, self.block_bytes, config.offload_priority)
        self.load_paths = LoadPaths(
            loop,
            name,
            host_link,
            host_store_link,
            self.lower_tiers,
            config.block_tokens,
            cost,
            config.fetch,
            config.load,
            config.tp,
        )
        self.load_orders = LoadOrders(self, self.load_paths, config.block_tokens)
        self.swaps = Swaps(self, config.swap_copy, config.block_tokens, self.block_bytes, cost.num_layers)
        self.swapped: dict[int, SimRequest] = {}
        self.swapped_views = SwappedViews()  # what the policy sees of `swapped`, kept by the swaps
        self.on_finish = on_finish
        self.on_prefill_done = on_prefill_done  # set for the prefill engine of a P/D pair
        self.tree = HiRadixTree({Tier.DEVICE: None, Tier.HOST: None, Tier.SSD: None, Tier.REMOTE: None})
        self.requests: dict[int, SimRequest] = {}
        # DecisionBackend.find: the dict's own get (the executor looks up every decode every step).
        self.find: Callable[[int], SimRequest | None] = self.requests.get
        self.waiting: list[tuple[float, int]] = []  # (arrival_s, req_id), kept sorted
        self.waiting_prompt_tokens = 0  # summed over the waiting requests (the router's load)
        self.waiting_version = 0  # bumped when `waiting` or a waiting watch changes (kvtier.sim.view)
        self.waiting_views: WaitingViews | None = None  # the head's views, kept while the version stays
        self.running: list[SimRequest] = []
        self.fetching: dict[int, SimRequest] = {}
        self.private_blocks = 0
        self.reserved_blocks = 0
        self.stepping = False
        self._kick_pending = False
        self.incoming: deque[SimRequest] = deque()  # P/D decode engines: KV arrived, awaiting blocks
        # Decode fast-forward (kvtier.sim.fast_forward): the running batch while the policy's
        # decision is known to be "decode them all"; False plans every step through the policy.
        self.decode_fast_forward = True
        self.decode_run: list[SimRequest] | None = None
        self.isolated: Callable[[], bool] | None = None  # set by a colocated Cluster (multi-step runs)
        if config.preload_tier is not None and config.preload_tier not in self.lower_tiers:
            raise SimError(
                f"engine {name!r} preloads tier {config.preload_tier.label!r}, which it does not have"
            )
        if config.host_blocks == 0 and self.offload != "none":
            raise SimError(f"policy {policy.name!r} offloads KV to host, but the engine has no host tier")

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
            self.lower_tiers.place(r.keys, self.config.preload_tier)
        self._enqueue(r)
        self.kick()

    def _enqueue(self, r: SimRequest) -> None:
        """Waiting: its blocks are marked in-queue (Strata §4.3.1 transient nodes)."""
        bisect.insort(self.waiting, (r.arrival_s, r.req_id))
        self.waiting_version += 1
        self.waiting_prompt_tokens += r.prompt_tokens
        self.tree.mark_in_queue(r.keys, True)
        r.queue_marked = True

    def waiting_changed(self) -> None:  # a waiting request's watch was released (its on_release)
        self.waiting_version += 1

    def kick(self) -> None:
        """Starts a step at the current instant unless one is running (arrivals at one instant batch)."""
        if self.stepping or self._kick_pending:
            return
        self._kick_pending = True
        self.loop.after(0.0, EventKind.WAKE, self._wake)

    def _wake(self) -> None:
        self._kick_pending = False
        if not self.stepping:
            self.start_step()

    def free_device_blocks(self) -> int:
        """Device blocks not holding anything (cached blocks excluded)."""
        used = self.tree.used_blocks(Tier.DEVICE) + self.private_blocks + self.reserved_blocks
        return self.config.device_blocks - used

    def available_device_blocks(self) -> int:
        """Blocks a new allocation can get: free ones plus unlocked cached ones (evicted on demand)."""
        return self.free_device_blocks() + self.tree.evictable_blocks(Tier.DEVICE)

    def start_step(self) -> None:
        if self.fetch_stall_since_s is not None:  # the GPU sat idle while async fetches ran
            self.metrics.fetch_stall_s += self.loop.now_s - self.fetch_stall_since_s
            self.fetch_stall_since_s = None
        if self.swaps.holds_start():  # the last step's swaps land first
            self.stepping = True
            return
        if self.decode_run is not None and next_step(self):  # the decision is known: no view
            return
        if self.incoming:
            self._admit_incoming()
        if self.config.swap_copy.eager:
            self.swaps.rotate_synced_blocks(self.config.offload_priority)
        step = Step(self, start_s=self.loop.now_s)
        view = self.view()
        decision = self.policy.schedule(view)
        if isinstance(view.waiting, WaitingViews):
            view.waiting.close()  # built against this instant's prefix index
        execute(decision, self, step)
        if step.empty():
            self.stepping = False
            if self.fetching:
                self.fetch_stall_since_s = self.loop.now_s
            busy = self.running or self.fetching or any(r.swap_pending for r in self.swapped.values())
            if not busy and self.waiting:
                self._check_not_stuck()
            return
        arm(self, view, decision, step)
        self.stepping = True
        shape = BatchShape(tuple(step.prefill_chunks), tuple(step.decode_contexts))
        paths = self.load_paths
        slowdown = max(
            [*paths.interference, *(paths.slowdown(ld.order, ld.blocks) for ld in step.loads)], default=0.0
        )
        step.compute_s = self.cost.step_time_s(shape) * (1.0 + slowdown)
        if self.swaps.holds_step(step):  # it computes once its swaps land
            return
        step.begin()

    def _check_not_stuck(self) -> None:
        head = self.requests[self.waiting[0][1]]
        raise SimError(
            f"engine {self.name!r} cannot admit request {head.req_id} ({head.prompt_tokens} prompt tokens) "
            f"with {self.available_device_blocks()} available of {self.config.device_blocks} device blocks and nothing "
            f"running: capacity or max_batch_tokens too small for one request, or the policy never admits it"
        )

    def error(self, message: str) -> SimError:
        return SimError(message)

    # ----------------------------------------------------------------------------------------
    # The view

    def view(self) -> SchedulerView:
        """What the policy sees now (:func:`kvtier.sim.view.build_view`)."""
        return build_view(self)

    # ----------------------------------------------------------------------------------------
    # Planning a step

    def admit(self, r: SimRequest) -> None:
        """Takes the device part of the cached prefix (free) and locks it."""
        m = self.tree.match(r.keys, now_s=self.loop.now_s)
        bt = self.config.block_tokens
        per_tier = [0, 0, 0, 0]
        for tier in m.tiers:
            per_tier[tier] += bt
        cached = cap_prefix(per_tier, r.prompt_tokens, bt)
        if r.matched_blocks is None:
            r.matched_blocks = m.keys_matched
        device_blocks = cached[Tier.DEVICE] // bt
        device_tokens = cached[Tier.DEVICE]
        self.tree.lock(r.keys[:device_blocks])
        r.locked_blocks = device_blocks
        if r.queue_marked:
            self.tree.mark_in_queue(r.keys, False)
            r.queue_marked = False
        if device_blocks < len(r.keys):  # the rest is in flight: loaded or computed from now on
            self.tree.mark_in_flight(r.keys, True, start=device_blocks)
            r.flight_marked = True
        r.computed_tokens = device_tokens
        r.hit_tokens[Tier.DEVICE] = device_tokens
        r.admitted = True
        forget_waiting_view(r)
        del self.waiting[self._waiting_index(r)]
        self.waiting_version += 1  # also when its watch was released already (no on_release left)
        self.waiting_prompt_tokens -= r.prompt_tokens
        r.phase = Phase.RUNNING
        self.running.append(r)

    def _waiting_index(self, r: SimRequest) -> int:
        i = bisect.bisect_left(self.waiting, (r.arrival_s, r.req_id))
        if i >= len(self.waiting) or self.waiting[i][1] != r.req_id:
            raise SimError(f"request {r.req_id} is not waiting")
        return i

    def plan_prefill(self, step: Step, r: SimRequest, n: int, load: LoadOrder | None) -> None:
        if r.phase is Phase.FETCHING:
            raise SimError(f"policy {self.policy.name!r} scheduled fetching request {r.req_id}")
        if not r.admitted:
            self.admit(r)
            if load is not None and load.mode is LoadMode.ASYNC:
                self.start_load(r, load)
                return
        loaded = 0
        if load is not None:
            loaded = self.load_orders.plan_step_load(step, r, load)
        n = min(n, r.prompt_tokens - r.computed_tokens - loaded)
        if n <= 0 and loaded == 0:
            return
        if not self._allocate(r, r.computed_tokens + loaded + n, exclude=r):
            return
        step.add_prefill(r, n, PrefillChunk(n, r.computed_tokens + loaded))

    def plan_decode(self, step: Step, r: SimRequest) -> None:
        context = r.prompt_tokens + r.generated_tokens
        # _allocate's test inline: most decodes stay inside the blocks they hold.
        held = r.locked_blocks + r.private_blocks + r.reserved_blocks
        if -(-(context + 1) // self.block_tokens) > held and not self._allocate(r, context + 1, exclude=r):
            return
        step.decodes.append((r, r.epoch))  # Step.add_decode inline (once per decode)
        step.decode_contexts.append(context)

    def _allocate(self, r: SimRequest, tokens_on_device: int, exclude: SimRequest) -> bool:
        """Grows ``r``'s private blocks to cover ``tokens_on_device``; preempts others if needed."""
        need = math.ceil(tokens_on_device / self.config.block_tokens) - r.locked_blocks - r.private_blocks
        need -= r.reserved_blocks
        if need <= 0:
            return True
        while not self.make_room(need):
            victim = next((v for v in reversed(self.running) if v is not exclude), None)
            if victim is None:
                return False
            self.preempt(victim)
        r.private_blocks += need
        self.private_blocks += need
        return True

    def make_room(self, blocks: int) -> bool:
        """Evicts unlocked cached device blocks until ``blocks`` are free; whether they are."""
        short = blocks - self.free_device_blocks()
        if short <= 0:  # free already (a swap-in's usual case: no second count)
            return True
        self.lower_tiers.evict_device(short)
        return self.free_device_blocks() >= blocks

    # ----------------------------------------------------------------------------------------
    # Loads (kvtier.sim.loads)

    def start_load(self, r: SimRequest, load: LoadOrder) -> None:
        self.load_orders.fetch(r, load)

    def prefetch(self, r: SimRequest, load: LoadOrder) -> None:
        self.load_orders.prefetch(r, load)

    def start_load_transfers(
        self, load: LoadOrder, blocks: list[tuple[int, Tier]], done: Callable[[], None]
    ) -> None:
        self.load_paths.start(load, blocks, done)

    def land_load(self, r: SimRequest, start_block: int, blocks: list[tuple[int, Tier]], epoch: int) -> bool:
        return self.load_orders.land(r, start_block, blocks, epoch)

    # ----------------------------------------------------------------------------------------
    # Completion, offload, preemption

    def commit_prefix(self, r: SimRequest) -> None:
        """Puts ``r``'s newly computed prompt blocks in the prefix index (device), locked."""
        full = len(r.keys) if r.prefill_done else r.computed_tokens // self.config.block_tokens
        start = r.locked_blocks
        if full <= start:
            return
        path = r.keys[:full]
        self.tree.insert(path, Tier.DEVICE, self.loop.now_s)
        self.extend_lock(r, full)
        moved = min(full - start, r.private_blocks)
        r.private_blocks -= moved
        self.private_blocks -= moved
        if self.offload == "write_through":
            self.lower_tiers.write_through(path, full - start)

    def extend_lock(self, r: SimRequest, end: int) -> None:
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
        if r.locked_blocks:  # unlocking an empty path changes nothing (a landed swap-out's release)
            self.tree.unlock(r.keys[: r.locked_blocks])
            r.locked_blocks = 0
        self.private_blocks -= r.private_blocks
        r.private_blocks = 0
        self.reserved_blocks -= r.reserved_blocks
        r.reserved_blocks = 0

    def preempt(self, r: SimRequest) -> None:
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
            prompt_full = r.prompt_tokens // self.config.block_tokens
            keep = min(len(r.req.finish_keys), prompt_full + freed)
            if keep > prompt_full and self.free_device_blocks() >= keep - prompt_full:
                self.tree.insert(r.req.finish_keys[:keep], Tier.DEVICE, self.loop.now_s)
        self.running.remove(r)
        del self.requests[r.req_id]
        if self.on_finish is not None:
            self.on_finish(r)

    # ----------------------------------------------------------------------------------------
    # Swap (preemption that keeps the KV, in host memory: kvtier.sim.swap)

    def swap_out(self, r: SimRequest) -> None:
        self.swaps.swap_out(r)

    def swap_in(self, r: SimRequest) -> None:
        self.swaps.swap_in(r)

    def end_swaps(self) -> None:
        self.swaps.end_swaps()

    # ----------------------------------------------------------------------------------------
    # P/D hand-off

    def hand_off(self, r: SimRequest) -> None:
        """P/D: the request leaves this (prefill) engine; its prompt stays cached here."""
        self.release(r)
        self.running.remove(r)
        del self.requests[r.req_id]

    def accept_decode(self, r: SimRequest) -> None:
        """P/D: a request whose KV just arrived joins the decode queue of this engine."""
        r.locked_blocks = r.private_blocks = r.reserved_blocks = 0
        r.computed_tokens = r.prompt_tokens
        self.requests[r.req_id] = r
        self.incoming.append(r)
        self.kick()

    def _admit_incoming(self) -> None:
        while self.incoming:
            r = self.incoming[0]
            need = math.ceil((r.prompt_tokens + r.generated_tokens) / self.config.block_tokens)
            if not self.make_room(need):  # never preempts: running decodes keep their blocks
                return
            r.private_blocks = need
            self.private_blocks += need
            self.incoming.popleft()
            r.phase = Phase.RUNNING
            self.running.append(r)

    def end_step(self, step: Step) -> None:
        finish_step(self, step)
        self.stepping = False
        self.start_step()
