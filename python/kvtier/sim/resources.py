"""Links: bandwidth shared among concurrent transfers, with priority classes, per direction.

A transfer is *work*: the seconds it would take alone on an idle link (bytes / bandwidth of its
direction, plus a fixed cost per segment: small segments are slow, Strata Fig. 3, SuperInfer
Fig. 5). Active transfers progress as a fluid (processor sharing): within one *pool* the
transfers of the most urgent active priority class share the capacity equally and lower classes
wait (strict priority: DualPath §5's traffic isolation, where KV traffic yields to the model's own
collectives). A duplex link (PCIe, NVLink-C2C) has one pool per direction; a half-duplex one (an
SSD: reads and writes share the flash) has a single pool for both.

Every change of the active set recomputes rates and reschedules completions: O(active) per
change, exact for piecewise-constant rates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from functools import partial

from kvtier.errors import SimError
from kvtier.sim.core import Event, EventKind, EventLoop
from kvtier.sim.cost import transfer_work_s
from kvtier.sim.hardware import LinkSpec, concurrent_scale

_EPS_S = 1e-12


class Direction(IntEnum):
    """Toward the GPU (loads, SSD reads) or away from it (offloads, SSD writes)."""

    IN = 0
    OUT = 1


@dataclass(eq=False, slots=True)
class Transfer:
    nbytes: int
    work_s: float
    direction: Direction
    priority: int
    on_done: Callable[[Transfer], None]
    submitted_s: float
    remaining_s: float = 0.0
    rate: float = 0.0
    finished_s: float | None = None
    event: Event | None = field(default=None, repr=False)


@dataclass(slots=True)
class _Pool:
    active: list[Transfer] = field(default_factory=list)
    busy_s: float = 0.0


class Link:
    """One link (PCIe, C2C, NIC, SSD) with per-direction bandwidth and per-segment overhead."""

    def __init__(
        self,
        loop: EventLoop,
        name: str,
        in_bytes_per_s: float,
        out_bytes_per_s: float,
        duplex: bool = True,
        per_segment_overhead_s: float = 0.0,
        duplex_total_bytes_per_s: float = 0.0,
        per_copy_bytes_per_s: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        for what, bw in (("in_bytes_per_s", in_bytes_per_s), ("out_bytes_per_s", out_bytes_per_s)):
            if not (bw > 0 and math.isfinite(bw)):
                raise SimError(f"link {name!r}: {what} is {bw}; expected a positive bandwidth")
        if per_segment_overhead_s < 0:
            raise SimError(
                f"link {name!r}: per_segment_overhead_s is {per_segment_overhead_s}; expected >= 0"
            )
        self.loop = loop
        self.name = name
        self.bandwidth_bytes_per_s = (in_bytes_per_s, out_bytes_per_s)
        # Copies launched one per segment (in, out): LinkSpec.per_copy_*_bytes_per_s; 0: as batched.
        if not all(math.isfinite(bw) and bw >= 0 for bw in per_copy_bytes_per_s):
            raise SimError(f"link {name!r}: per_copy_bytes_per_s is {per_copy_bytes_per_s}; expected >= 0")
        self.per_copy_bytes_per_s: tuple[float, ...] = tuple(
            bw or full for bw, full in zip(per_copy_bytes_per_s, self.bandwidth_bytes_per_s, strict=True)
        )
        self.duplex = duplex
        self.per_segment_overhead_s = per_segment_overhead_s
        # While both directions of a duplex link are busy each runs at this fraction of its rate: a
        # half-duplex memory behind the link caps them together (LinkSpec.duplex_total_bytes_per_s).
        if not (math.isfinite(duplex_total_bytes_per_s) and duplex_total_bytes_per_s >= 0):
            raise SimError(f"link {name!r}: duplex_total_bytes_per_s is {duplex_total_bytes_per_s}")
        self._concurrent_scale = (
            concurrent_scale(in_bytes_per_s, out_bytes_per_s, duplex_total_bytes_per_s) if duplex else 1.0
        )
        self._pools = (_Pool(), _Pool()) if duplex else (_Pool(),)
        self._last_update_s = 0.0
        self.bytes_moved = [0, 0]
        self.transfers_done = 0

    @classmethod
    def of(cls, loop: EventLoop, name: str, spec: LinkSpec, tp: int = 1) -> Link:
        """The link a profile's ``host_link`` describes, ``tp`` of them side by side."""
        return cls(
            loop,
            name,
            spec.h2d_bytes_per_s * tp,
            spec.d2h_bytes_per_s * tp,
            duplex=spec.duplex,
            per_segment_overhead_s=spec.per_segment_overhead_s,
            duplex_total_bytes_per_s=spec.duplex_total_bytes_per_s * tp,
            per_copy_bytes_per_s=(spec.per_copy_h2d_bytes_per_s * tp, spec.per_copy_d2h_bytes_per_s * tp),
        )

    def work_s(self, nbytes: int, segment_bytes: int, direction: Direction, batched: bool = False) -> float:
        """Seconds ``nbytes`` in segments of ``segment_bytes`` take alone on this link: one copy
        launch per segment, or one launch for them all (``batched``, SuperInfer §4.3.2 "MK")."""
        rates = self.bandwidth_bytes_per_s if batched else self.per_copy_bytes_per_s
        bandwidth = rates[direction]
        return transfer_work_s(max(nbytes, 0), max(1, segment_bytes), bandwidth, self.per_segment_overhead_s)

    def submit(
        self,
        nbytes: int,
        direction: Direction,
        on_done: Callable[[Transfer], None],
        segment_bytes: int | None = None,
        priority: int = 1,
        batched: bool = False,
    ) -> Transfer:
        """Starts a transfer now; ``on_done`` runs when its last byte lands."""
        if nbytes < 0:
            raise SimError(f"link {self.name!r}: transfer of {nbytes} bytes")
        work = self.work_s(nbytes, segment_bytes or max(nbytes, 1), direction, batched)
        t = Transfer(nbytes, work, direction, priority, on_done, self.loop.now_s, remaining_s=work)
        self.advance()
        if work <= _EPS_S:
            t.finished_s = self.loop.now_s
            self.loop.after(0.0, EventKind.TRANSFER_DONE, partial(self.finish, t))
            return t
        self.pool_of_direction(direction).active.append(t)
        self.reschedule()
        return t

    def pool_of_direction(self, direction: Direction) -> _Pool:
        return self._pools[direction if self.duplex else 0]

    def pool_of(self, t: Transfer) -> _Pool:
        return self.pool_of_direction(t.direction)

    def advance(self) -> None:
        """Charges progress since the last change to every active transfer."""
        now = self.loop.now_s
        dt = now - self._last_update_s
        if dt > 0:
            for pool in self._pools:
                if pool.active:
                    pool.busy_s += dt
                for t in pool.active:
                    t.remaining_s -= t.rate * dt
        self._last_update_s = now

    def reschedule(self) -> None:
        pools = self._pools
        both_busy = len(pools) == 2 and bool(pools[0].active) and bool(pools[1].active)
        scale = self._concurrent_scale if both_busy else 1.0
        for pool in pools:
            active = pool.active
            if not active:
                continue
            # The most urgent class and how many share it: one pass, no generators (a transfer's
            # submit and landing each re-share a pool of a few).
            top, sharing = active[0].priority, 0
            for t in active:
                if t.priority < top:
                    top, sharing = t.priority, 1
                elif t.priority == top:
                    sharing += 1
            share = scale / sharing
            for t in active:
                rate = share if t.priority == top else 0.0
                if t.event is not None and rate == t.rate:
                    continue  # unchanged: keep its completion event
                t.rate = rate
                if t.event is not None:
                    t.event.cancel()
                    t.event = None
                if rate > 0:
                    done_in = max(t.remaining_s, 0.0) / rate
                    t.event = self.loop.after(done_in, EventKind.TRANSFER_DONE, partial(self._complete, t))

    def _complete(self, t: Transfer) -> None:
        """The ``TRANSFER_DONE`` event: ``t``'s last byte lands. Charges progress, drops ``t`` from its
        pool, re-shares the bandwidth among the transfers left, and runs ``t``'s callback (which may
        start a step, land a load, or place offloaded blocks in a lower tier)."""
        self.advance()
        t.event = None
        self.pool_of(t).active.remove(t)
        t.remaining_s = 0.0
        self.reschedule()
        self.finish(t)

    def finish(self, t: Transfer) -> None:
        t.finished_s = self.loop.now_s
        self.bytes_moved[t.direction] += t.nbytes
        self.transfers_done += 1
        t.on_done(t)

    def active(self) -> int:
        return sum(len(p.active) for p in self._pools)

    def busy_s(self) -> tuple[float, ...]:
        """Seconds each pool had at least one active transfer (per direction when duplex)."""
        self.advance()
        return tuple(p.busy_s for p in self._pools)


class StripedLink:
    """Several devices (SSDs) striped as one: a transfer is split across them (evenly here; by
    :meth:`parts` in subclasses) and done when every part is; each device keeps its own queue."""

    def __init__(self, name: str, devices: list[Link]) -> None:
        if not devices:
            raise SimError(f"striped link {name!r} needs at least one device")
        self.name = name
        self.devices = devices
        self.loop = devices[0].loop

    def parts(self, nbytes: int) -> list[int]:
        """Bytes each device carries of an ``nbytes`` transfer: an even split."""
        n = len(self.devices)
        nbytes = max(nbytes, 0)
        return [nbytes // n + (1 if i < nbytes % n else 0) for i in range(n)]

    def work_s(self, nbytes: int, segment_bytes: int, direction: Direction) -> float:
        pairs = zip(self.devices, self.parts(nbytes), strict=True)
        return max((d.work_s(p, segment_bytes, direction) for d, p in pairs if p > 0), default=0.0)

    def submit(
        self,
        nbytes: int,
        direction: Direction,
        on_done: Callable[[Transfer], None],
        segment_bytes: int | None = None,
        priority: int = 1,
    ) -> Transfer:
        used = [(d, p) for d, p in zip(self.devices, self.parts(nbytes), strict=True) if p > 0]
        if not used:  # nothing to move: complete through the first device's queue, at once
            used = [(self.devices[0], 0)]
        whole = Transfer(nbytes, 0.0, direction, priority, on_done, self.loop.now_s)
        pending = [len(used)]

        def part_done(_t: Transfer) -> None:
            pending[0] -= 1
            if pending[0] == 0:
                whole.finished_s = self.loop.now_s
                on_done(whole)

        for device, part in used:
            device.submit(part, direction, part_done, segment_bytes, priority)
        return whole


class WeightedStripedLink(StripedLink):
    """Devices of unequal speed (DRAM modules, SSDs) pooled as one (Unified KV pooling §IV-A): a
    transfer of ``n`` items of ``item_bytes`` (one layer of one cache block) is split by
    ``split(n)`` — per-device item counts, e.g. the bandwidth-aware allocator's Algorithm 1 — and
    the parts run in parallel, each in its device's own queue; done when every part is. The last
    item may be partial: the bytes past ``nbytes`` come off the last device that got items."""

    def __init__(
        self, name: str, devices: list[Link], split: Callable[[int], list[int]], item_bytes: int
    ) -> None:
        super().__init__(name, devices)
        if item_bytes < 1:
            raise SimError(f"pooled link {name!r}: item_bytes is {item_bytes}; expected >= 1")
        self.split = split
        self.item_bytes = item_bytes

    def parts(self, nbytes: int) -> list[int]:
        """Bytes each device carries of an ``nbytes`` transfer."""
        items = -(-max(nbytes, 0) // self.item_bytes)
        counts = self.split(items)
        if len(counts) != len(self.devices) or sum(counts) != items or min(counts, default=0) < 0:
            raise SimError(
                f"pooled link {self.name!r}: split({items}) gave {counts}; expected "
                f"{len(self.devices)} counts >= 0 summing to {items}"
            )
        parts = [c * self.item_bytes for c in counts]
        excess = items * self.item_bytes - max(nbytes, 0)
        if excess:
            last = max(i for i, c in enumerate(counts) if c > 0)
            parts[last] -= excess
        return parts
