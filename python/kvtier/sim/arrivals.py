"""Arrivals, shared by every simulated cluster: the workload's requests streamed in.

Open-loop requests are pulled lazily from the workload iterator, one ahead (the next is scheduled
when the previous lands), so memory stays bounded however long the trace. A closed-loop request
(the next turn of a chat or an agent, :attr:`Request.parent_id`) is held until its parent finishes
and arrives ``think_time_s`` later (:meth:`Arrivals.follow`; at once with none).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

from kvtier.sim.core import EventKind, EventLoop
from kvtier.sim.request import Request


class Arrivals:
    """Calls ``arrive(req)`` at each request's arrival time."""

    def __init__(self, loop: EventLoop, arrive: Callable[[Request], None]) -> None:
        self.loop = loop
        self._arrive = arrive
        self._children: dict[int, list[Request]] = {}
        self._source: Iterator[Request] | None = None

    def feed(self, requests: Iterator[Request]) -> None:
        self._source = requests
        self._pull()

    def _pull(self) -> None:
        assert self._source is not None
        for req in self._source:
            if req.parent_id is not None:
                self._children.setdefault(req.parent_id, []).append(req)
                continue
            self.loop.schedule(req.arrival_s, EventKind.ARRIVAL, partial(self._land, req))
            return

    def _land(self, req: Request) -> None:
        self._arrive(req)
        if req.parent_id is None:
            self._pull()

    def children(self, req_id: int) -> list[Request]:
        """The requests waiting for ``req_id`` to finish (each to be :meth:`follow`-ed)."""
        return self._children.pop(req_id, [])

    def follow(self, child: Request, parent_finish_s: float) -> None:
        """``child`` arrives its think time after its parent finished. With no think time it lands at
        once: a client that sends the next turn the moment a reply ends has it in the engine's next
        step, as the reference engine's loop does (an event at the same instant would land after
        that step had started, a whole step late)."""
        child.arrival_s = parent_finish_s + child.think_time_s
        if child.think_time_s == 0:
            self._land(child)
        else:
            self.loop.schedule(child.arrival_s, EventKind.ARRIVAL, partial(self._land, child))

    def held_children(self) -> bool:
        """Whether a pulled request waits for its parent to finish (a finish may then arrive one)."""
        return bool(self._children)

    def finished(self, req_id: int, now_s: float) -> None:
        """``req_id`` finished at ``now_s``: its children follow."""
        for child in self.children(req_id):
            self.follow(child, now_s)
