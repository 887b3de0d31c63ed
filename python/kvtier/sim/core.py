"""The event core: a heap of events ordered by ``(time_s, kind, seq)``.

``kind`` gives a fixed order to events at the same instant (transfers land before steps end, steps
end before new arrivals are admitted), and ``seq`` (insertion order) breaks the remaining ties, so a
run is a pure function of its config and seed. Cancelled events stay in the heap, flagged, and are
skipped when popped (O(log n) cancellation without a search).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

from kvtier.errors import SimError


class EventKind(IntEnum):
    """Order of events at the same instant: lower first."""

    TRANSFER_DONE = 0
    STEP_END = 1
    ARRIVAL = 2
    WAKE = 3


@dataclass(order=True, slots=True)
class Event:
    time_s: float
    kind: EventKind
    seq: int
    action: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    """Pops events in order and runs their actions; actions schedule further events."""

    def __init__(self) -> None:
        self.now_s = 0.0
        # (time_s, kind, seq, event): tuples compare in C (the dataclass's __lt__ is a Python call per
        # comparison, ~4 a push or pop); seq is unique, so the event itself is never compared.
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = 0
        self.events_run = 0
        self.until_s: float | None = None  # the running ``run``'s bound

    def horizon_s(self) -> float:
        """The earliest pending event that is not a step's end, or the running ``run``'s bound if
        sooner (inf: none): what a multi-step decode fast-forward must stop before
        (:mod:`kvtier.sim.fast_forward`)."""
        step_end = EventKind.STEP_END
        soonest = math.inf if self.until_s is None else self.until_s
        for time_s, kind, _, event in self._heap:
            if time_s < soonest and kind != step_end and not event.cancelled:
                soonest = time_s
        return soonest

    def schedule(self, time_s: float, kind: EventKind, action: Callable[[], None]) -> Event:
        if time_s < self.now_s - 1e-12:
            raise SimError(f"event scheduled in the past: {time_s} < now {self.now_s}")
        self._seq += 1
        event = Event(max(time_s, self.now_s), kind, self._seq, action)
        heapq.heappush(self._heap, (event.time_s, int(kind), event.seq, event))
        return event

    def after(self, delay_s: float, kind: EventKind, action: Callable[[], None]) -> Event:
        return self.schedule(self.now_s + delay_s, kind, action)

    def pending(self) -> int:
        return len(self._heap)

    def exhausted(self) -> bool:
        """Whether no event is left to run (cancelled ones do not count): a ``run`` that ended so
        ran out of events rather than reaching its bound."""
        return all(event.cancelled for *_, event in self._heap)

    def run(self, until_s: float | None = None) -> None:
        """Runs events until the heap is empty or the next event is after ``until_s``."""
        heap, pop = self._heap, heapq.heappop
        self.until_s = until_s
        while heap:
            if until_s is not None and heap[0][0] > until_s:
                self.now_s = until_s
                return
            event = pop(heap)[3]
            if event.cancelled:
                continue
            self.now_s = event.time_s
            self.events_run += 1
            event.action()
