"""Swap in the simulated engine: preemption that keeps a request's KV in host memory
(:class:`Swaps`, one seam of :mod:`kvtier.sim.engine`).

How the copies cross the host link follows the engine's :class:`SwapCopy` (SuperInfer §4.3; data-plane
config, ``EngineConfig.swap_copy``):
one copy per request, or one batched copy per direction per step; both directions at once (duplex)
or one copy at a time, FIFO; independent of the steps, or step-synced (``step``: the step's compute
waits for its swaps; ``next_step``: the next step starts once they landed). With eager rotation,
blocks filled since the last step are copied to host in the background, so a swap-out moves only
the dirty tail. A swap-out host cannot hold falls back to preemption by recompute; a swap-in whose
device blocks are not free now does nothing (the policy asks again).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Protocol

from kvtier.errors import SimError
from kvtier.sched.base import Policy
from kvtier.sched.members import HOST, RUNNING, SWAPPED
from kvtier.sched.swap_copy import SwapCopy
from kvtier.sim.events.step_end import Step
from kvtier.sim.metrics import Metrics
from kvtier.sim.owner import SeamOwner
from kvtier.sim.resources import Direction, Link, Transfer
from kvtier.sim.state import SimRequest
from kvtier.sim.view import SwappedViews

Landed = Callable[[Transfer], None]


class SwapOwner(SeamOwner, Protocol):
    """What swapping reads and calls of the engine that owns it."""

    name: str
    stepping: bool
    private_blocks: int  # device blocks outside the prefix index, all requests together
    policy: Policy
    metrics: Metrics
    host_link: Link
    swapped: dict[int, SimRequest]
    swapped_views: SwappedViews  # what the policy is shown of `swapped`, kept here as swaps change it

    def release(self, r: SimRequest) -> None: ...
    def preempt(self, r: SimRequest) -> None: ...
    def start_step(self) -> None: ...


class Swaps:
    def __init__(
        self, owner: SwapOwner, copy: SwapCopy, block_tokens: int, block_bytes: int, num_layers: int
    ) -> None:
        self._owner = owner
        self.copy = copy
        self._block_tokens = block_tokens
        self._block_bytes = block_bytes
        self._num_layers = num_layers
        # The FIFO of copies that run one at a time (not duplex), this step's batched copies,
        # step-synced swaps in flight, and the step (or step start) they hold.
        self._serial: deque[Callable[[], None]] = deque()
        self._serial_busy = False
        self._batches: dict[Direction, list[tuple[int, Landed]]] = {Direction.IN: [], Direction.OUT: []}
        self.barrier = 0
        self._held_step: Step | None = None
        self._held_start_s: float | None = None
        self._host = HOST in owner.lower_tiers  # the engine's tiers are fixed at its start

    def swap_out(self, r: SimRequest) -> None:
        """Moves a running request's KV to host; its device blocks free when the copy has landed."""
        owner, tiers = self._owner, self._owner.lower_tiers
        if not self._host:
            raise SimError(
                f"policy {owner.policy.name!r} swaps out, but engine {owner.name!r} has no host tier"
            )
        blocks = math.ceil((r.computed_tokens + r.generated_tokens) / self._block_tokens)
        if tiers.free_blocks(HOST) < blocks:  # make_room's own first test, spelled here
            tiers.make_room(HOST, blocks)
            if tiers.free_blocks(HOST) < blocks:
                owner.preempt(r)  # host cannot hold it: fall back to recompute
                return
        tiers.swap_host_blocks += blocks
        r.swapped_blocks = blocks
        owner.running.remove(r)
        r.phase = SWAPPED
        r.epoch += 1
        r.swap_pending = True
        owner.swapped[r.req_id] = r
        owner.swapped_views.issued(r)
        copy = self.copy
        # min(): an eager copy issued before a recompute preemption may land after it.
        moved = blocks - min(r.host_synced_blocks, blocks) if copy.eager else blocks
        if copy.eager or copy.sync == "step":
            # Eager rotation: synced blocks have a host copy, so only the dirty tail stays held until
            # it lands (SuperInfer §4.3.2). sync "step": the copy runs before the step writes HBM.
            owner.release(r)
            hold = 0 if copy.sync == "step" else moved
            r.private_blocks = hold
            owner.private_blocks += hold
        if copy.sync != "none":
            self.barrier += 1

        def landed(_t: Transfer) -> None:
            owner.release(r)
            r.swap_pending = False
            owner.swapped_views.landed(r)
            r.host_copied_blocks = r.host_synced_blocks = (
                r.computed_tokens + r.generated_tokens
            ) // self._block_tokens
            self._landed(copy)
            owner.kick()

        self._submit(moved * self._block_bytes, Direction.OUT, landed)

    def swap_in(self, r: SimRequest) -> None:
        owner = self._owner
        if r.swap_pending:  # not in the policy's view
            raise SimError(
                f"policy {owner.policy.name!r} swaps in request {r.req_id}, which is not swapped out"
            )
        blocks = r.swapped_blocks
        if not owner.make_room(blocks):
            return  # not now: the policy will ask again
        r.private_blocks += blocks
        owner.private_blocks += blocks
        r.swap_pending = True
        owner.swapped_views.hidden(r)
        copy = self.copy
        if copy.sync != "none":
            self.barrier += 1

        def landed(_t: Transfer) -> None:
            owner.lower_tiers.swap_host_blocks -= r.swapped_blocks
            r.swapped_blocks = 0
            r.swap_pending = False
            del owner.swapped[r.req_id]
            owner.swapped_views.left(r)
            r.phase = RUNNING
            owner.running.append(r)
            self._landed(copy)
            owner.kick()

        self._submit(blocks * self._block_bytes, Direction.IN, landed)

    def _submit(self, nbytes: int, direction: Direction, landed: Landed) -> None:
        """Batched or step-synced swaps leave as one copy per direction per step (cudaMemcpyBatchAsync;
        vLLM's swap_blocks), see :meth:`end_swaps`; others one per request."""
        copy = self.copy
        if copy.batched or copy.sync != "none":
            self._batches[direction].append((nbytes, landed))
        else:
            self._send(nbytes, direction, landed)

    def end_swaps(self) -> None:
        """The step's swaps are all issued: the batched ones leave, one copy per direction."""
        for direction in (Direction.OUT, Direction.IN):
            batch, self._batches[direction] = self._batches[direction], []
            if batch:

                def landed(t: Transfer, batch: list[tuple[int, Landed]] = batch) -> None:
                    for _, done in batch:
                        done(t)

                self._send(sum(n for n, _ in batch), direction, landed)

    def _send(self, nbytes: int, direction: Direction, landed: Landed) -> None:
        owner = self._owner
        segment = self._segment_bytes(nbytes)
        copy = self.copy
        if copy.duplex:
            owner.host_link.submit(nbytes, direction, landed, segment, priority=1, batched=copy.batched)
            return

        def start() -> None:  # one copy at a time, FIFO: a swap-in may reuse blocks a swap-out frees
            def done(t: Transfer) -> None:
                landed(t)
                self._next_serial()

            owner.host_link.submit(nbytes, direction, done, segment, priority=1, batched=copy.batched)

        self._serial.append(start)
        if not self._serial_busy:
            self._next_serial()

    def _next_serial(self) -> None:
        """Starts the next queued swap copy (SwapCopy.duplex False: SuperInfer §4.3.2, Fig. 13 left)."""
        self._serial_busy = bool(self._serial)
        if self._serial:
            self._serial.popleft()()

    def _segment_bytes(self, nbytes: int) -> int:
        """Bytes per copy launch of a swap (SuperInfer §4.3.1, :meth:`SwapCopy.segment_bytes`)."""
        return self.copy.segment_bytes(nbytes, self._block_bytes, self._num_layers)

    def holds_start(self) -> bool:
        """Sync ``next_step`` with swaps in flight: the next step starts once they land."""
        if self.barrier and self.copy.sync == "next_step":
            self._held_start_s = self._owner.loop.now_s
            return True
        return False

    def holds_step(self, step: Step) -> bool:
        """Sync ``step`` with swaps in flight: ``step`` computes once they land."""
        if self.barrier and self.copy.sync == "step":
            self._held_step = step
            return True
        return False

    def _landed(self, copy: SwapCopy) -> None:
        """A step-synced swap landed: once all have, the held step computes (sync "step") or the
        held next step starts (sync "next_step"); the wait is blocked I/O."""
        if copy.sync == "none":
            return
        self.barrier -= 1
        if self.barrier:
            return
        owner = self._owner
        now = owner.loop.now_s
        if self._held_step is not None:
            step, self._held_step = self._held_step, None
            owner.metrics.blocked_io_s += now - step.start_s
            step.begin()
        elif self._held_start_s is not None:
            owner.metrics.blocked_io_s += now - self._held_start_s
            self._held_start_s, owner.stepping = None, False
            owner.start_step()

    def rotate_synced_blocks(self, offload_priority: int) -> None:
        """Eager block rotation (SuperInfer §4.3.2): blocks filled since the last step take no more
        writes, so their host copy starts now, in the background (below swaps on the link). Their
        host space is not charged (at most the device's KV); a swap-out then moves the dirty tail."""
        newly: list[tuple[SimRequest, int]] = []
        blocks = 0
        block_tokens, add = self._block_tokens, newly.append
        for r in self._owner.running:
            full = (r.computed_tokens + r.generated_tokens) // block_tokens
            if full > (copied := r.host_copied_blocks):
                blocks += full - copied
                r.host_copied_blocks = full
                add((r, full))
        if not newly:
            return

        def synced(_t: Transfer) -> None:
            for r, full in newly:
                r.host_synced_blocks = max(r.host_synced_blocks, full)

        nbytes = blocks * self._block_bytes
        segment = self._segment_bytes(nbytes)
        self._owner.host_link.submit(nbytes, Direction.OUT, synced, segment, offload_priority)
