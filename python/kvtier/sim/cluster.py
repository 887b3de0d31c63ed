"""Engines put together: colocated engines behind a router, or P/D-disaggregated groups.

The cluster owns request lifecycles across engines: open-loop arrivals are pulled lazily from
the workload iterator (one ahead, so memory stays bounded), closed-loop requests wait for their
parent to finish plus a think time, and finished requests are folded into the metrics.

P/D: a prefill engine computes the prompt (and the first token), then the request's KV crosses
the compute network to a decode engine, which decodes it to the end (DualPath §2, Fig. 1).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from functools import partial

from kvtier.errors import ConfigError, SimError
from kvtier.sched.base import Phase
from kvtier.sim.core import EventKind, EventLoop
from kvtier.sim.engine import Engine
from kvtier.sim.events.arrival import deliver
from kvtier.sim.metrics import Metrics, RequestRecord
from kvtier.sim.request import Request
from kvtier.sim.resources import Direction, Link, Transfer
from kvtier.sim.state import SimRequest

ROUTERS = ("round_robin", "least_loaded", "prefix_aware")


class Cluster:
    def __init__(
        self,
        loop: EventLoop,
        metrics: Metrics,
        engines: list[Engine],
        decode_engines: list[Engine] | None = None,
        pd_link: Link | None = None,
        router: str = "least_loaded",
        max_outstanding: int | None = None,
    ) -> None:
        if router not in ROUTERS:
            raise ConfigError(f"unknown router {router!r}; expected one of {list(ROUTERS)}")
        if not engines:
            raise ConfigError("a cluster needs at least one engine")
        self.loop = loop
        self.metrics = metrics
        self.engines = engines  # colocated engines, or the prefill engines of a P/D cluster
        self.decode_engines = decode_engines or []
        self.pd_link = pd_link
        self.router = router
        self._rr = 0
        # A benchmark client's concurrency cap (Strata §5.1: at most 128 in-flight queries): an
        # arrival beyond it waits at the client and is sent, its TTFT clock starting then, when a
        # request finishes. None: open loop, every arrival is sent at once.
        if max_outstanding is not None and max_outstanding < 1:
            raise ConfigError(f"max_outstanding is {max_outstanding}; expected >= 1 or None")
        self.max_outstanding = max_outstanding
        self.outstanding = 0
        self.held: deque[Request] = deque()
        self._children: dict[int, list[Request]] = {}
        self._source: Iterator[Request] | None = None
        self.finished = 0
        for e in engines:
            e.on_finish = self._finished
            if self.decode_engines:
                e.on_prefill_done = self._prefill_done
        for d in self.decode_engines:
            d.on_finish = self._finished

    # Arrivals ---------------------------------------------------------------------------------

    def feed(self, requests: Iterator[Request]) -> None:
        """Streams ``requests`` in: the next open-loop arrival is scheduled when the previous lands."""
        self._source = requests
        self._pull()

    def _pull(self) -> None:
        assert self._source is not None
        for req in self._source:
            if req.parent_id is not None:
                self._children.setdefault(req.parent_id, []).append(req)
                continue
            self.loop.schedule(req.arrival_s, EventKind.ARRIVAL, partial(self._arrive, req))
            return

    def _arrive(self, req: Request) -> None:
        if self.max_outstanding is not None and self.outstanding >= self.max_outstanding:
            self.held.append(req)
        else:
            self.outstanding += 1
            deliver(self, req)
        if req.parent_id is None:
            self._pull()

    def route(self, req: Request) -> Engine:
        engines = self.engines
        if len(engines) == 1:
            return engines[0]
        if self.router == "round_robin":
            self._rr = (self._rr + 1) % len(engines)
            return engines[self._rr]
        if self.router == "prefix_aware":
            best = max(engines, key=lambda e: (e.tree.match(req.block_keys).keys_matched, -_load(e)))
            if best.tree.match(req.block_keys).keys_matched > 0:
                return best
        return min(engines, key=_load)

    # Completion ---------------------------------------------------------------------------------

    def _finished(self, r: SimRequest) -> None:
        now = self.loop.now_s
        assert r.first_token_s is not None
        self.metrics.add_request(
            RequestRecord(
                arrival_s=r.req.arrival_s,
                first_token_s=r.first_token_s,
                finish_s=now,
                prompt_tokens=r.req.prompt_tokens,
                output_tokens=r.req.output_tokens,
                hit_tokens=(r.hit_tokens[0], r.hit_tokens[1], r.hit_tokens[2], r.hit_tokens[3]),
                max_tbt_s=r.max_tbt_s,
                matched_blocks=r.matched_blocks or 0,
                prompt_blocks=len(r.keys),
            )
        )
        self.finished += 1
        self.outstanding -= 1
        if self.held:  # the client sends its oldest held request now
            sent = self.held.popleft()
            sent.arrival_s = now
            self.outstanding += 1
            deliver(self, sent)
        for child in self._children.pop(r.req_id, []):
            child.arrival_s = now + child.think_time_s
            self.loop.schedule(child.arrival_s, EventKind.ARRIVAL, partial(self._arrive, child))

    def _prefill_done(self, r: SimRequest) -> None:
        """P/D: the prefill engine hands the request (and its KV) to a decode engine."""
        prefill_engine = next(e for e in self.engines if r.req_id in e.requests)
        prefill_engine.hand_off(r)
        if r.generated_tokens >= r.req.output_tokens:
            self._finished(r)
            return
        decode = min(self.decode_engines, key=_load)
        nbytes = r.req.prompt_tokens * prefill_engine.cost.kv_bytes_per_token
        if self.pd_link is None:
            raise SimError("a P/D cluster needs a pd_link for the KV transfer")

        def arrived(_t: Transfer) -> None:
            r.phase = Phase.RUNNING
            decode.accept_decode(r)

        self.pd_link.submit(nbytes, Direction.OUT, arrived, segment_bytes=nbytes, priority=1)


def _load(e: Engine) -> float:
    """Outstanding work of an engine, in tokens (prompt left to compute plus running requests)."""
    return float(e.waiting_prompt_tokens + len(e.running) + len(e.fetching))
