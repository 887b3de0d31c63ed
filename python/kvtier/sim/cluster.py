"""Engines put together: colocated engines behind a router, or P/D-disaggregated groups.

The cluster owns request lifecycles across engines: arrivals come from
:class:`~kvtier.sim.arrivals.Arrivals` (shared with the DualPath cluster), a global scheduler
(:mod:`kvtier.sched.placement`: a router) picks each request's engine, and finished requests are
folded into the metrics.

P/D: a prefill engine computes the prompt (and the first token), then the request's KV crosses
the compute network to a decode engine, which decodes it to the end (DualPath §2, Fig. 1).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from kvtier.errors import ConfigError, SimError
from kvtier.sched.base import Phase
from kvtier.sched.placement import (
    EngineLoad,
    GlobalScheduler,
    PendingRequest,
    Placement,
    Role,
    least_loaded,
    make_router,
)
from kvtier.sim.arrivals import Arrivals
from kvtier.sim.core import EventLoop
from kvtier.sim.cost import engine_kv_bytes_per_token
from kvtier.sim.engine import Engine
from kvtier.sim.events.arrival import deliver
from kvtier.sim.metrics import Metrics, RequestRecord
from kvtier.sim.request import Request
from kvtier.sim.resources import Direction, Link, Transfer
from kvtier.sim.state import SimRequest
from kvtier.tiers import PerTier


class Cluster:
    def __init__(
        self,
        loop: EventLoop,
        metrics: Metrics,
        engines: list[Engine],
        decode_engines: list[Engine] | None = None,
        pd_link: Link | None = None,
        router: str | GlobalScheduler = "least_loaded",
        max_outstanding: int | None = None,
    ) -> None:
        if not engines:
            raise ConfigError("a cluster needs at least one engine")
        self.scheduler = make_router(router) if isinstance(router, str) else router
        if self.scheduler.fetch_interval_s is not None or self.scheduler.topology != "engines":
            raise ConfigError(f"global scheduler {self.scheduler.name!r} does not place requests on arrival")
        self.loop = loop
        self.metrics = metrics
        self.engines = engines  # colocated engines, or the prefill engines of a P/D cluster
        self.decode_engines = decode_engines or []
        self.pd_link = pd_link
        # A benchmark client's concurrency cap (Strata §5.1: at most 128 in-flight queries): an
        # arrival beyond it waits at the client and is sent, its TTFT clock starting then, when a
        # request finishes. None: open loop, every arrival is sent at once.
        if max_outstanding is not None and max_outstanding < 1:
            raise ConfigError(f"max_outstanding is {max_outstanding}; expected >= 1 or None")
        self.max_outstanding = max_outstanding
        self.outstanding = 0
        self.held: deque[Request] = deque()
        self.arrivals = Arrivals(loop, self._arrive)
        self._placing: Request | None = None
        self._placed: Engine | None = None
        self.finished = 0
        self.placed = [0] * len(engines)  # requests the global scheduler placed on each engine
        for e in engines:
            e.on_finish = self._finished
            if self.decode_engines:
                e.on_prefill_done = self._prefill_done
        for d in self.decode_engines:
            d.on_finish = self._finished
        if not self.decode_engines:
            for e in engines:
                e.isolated = self._isolated

    def _isolated(self) -> bool:
        """Whether, until the next arrival, no engine's events can reach another engine: colocated,
        open loop, no closed-loop request waiting for a parent (a finish only folds its record);
        what lets an engine fast-forward several decode steps (:mod:`kvtier.sim.fast_forward`)."""
        return self.max_outstanding is None and not self.arrivals.held_children()

    # Arrivals and placement ----------------------------------------------------------------------

    def feed(self, requests: Iterator[Request]) -> None:
        """Streams ``requests`` in (:class:`~kvtier.sim.arrivals.Arrivals`)."""
        self.arrivals.feed(requests)

    def _arrive(self, req: Request) -> None:
        if self.max_outstanding is not None and self.outstanding >= self.max_outstanding:
            self.held.append(req)
        else:
            self.outstanding += 1
            deliver(self, req)

    def route(self, req: Request) -> Engine:
        """The engine the global scheduler places ``req`` on."""
        self._placing, self._placed = req, None
        self.scheduler.arrive(PendingRequest(req.req_id, req.prompt_tokens, 0, req.output_tokens), self)
        engine = self._take_placed()
        if engine is None:
            raise SimError(f"global scheduler {self.scheduler.name!r} did not place request {req.req_id}")
        return engine

    def _take_placed(self) -> Engine | None:
        """The engine :meth:`place` was given during ``arrive`` in :meth:`route`, and forgets it. Read
        through a call: read in :meth:`route` right after ``arrive``, mypy (and so mypyc, which trusts
        it: kvtier.sim.compiled) would narrow it to the None set before the call."""
        engine, self._placing, self._placed = self._placed, None, None
        return engine

    def groups(self, role: Role) -> int:
        return 1

    def loads(self, role: Role, group: int | None = None) -> list[EngineLoad]:
        engines = self.engines if role is Role.PREFILL else self.decode_engines
        return [EngineLoad(i, 0, len(e.requests), _load(e), 0) for i, e in enumerate(engines)]

    def read_queue_tokens(self, engine_id: int) -> int:
        return 0  # reads are each engine's own (its links), not a node queue

    def prefix_blocks(self, req_id: int, engine_id: int) -> int:
        assert self._placing is not None and self._placing.req_id == req_id
        return self.engines[engine_id].tree.match(self._placing.block_keys).keys_matched

    def place(self, placement: Placement) -> None:
        if placement.role is not Role.PREFILL or self._placing is None:
            raise SimError(
                f"global scheduler {self.scheduler.name!r} places a request twice or on a decode engine"
            )
        self._placed = self.engines[placement.engine_id]
        self.placed[placement.engine_id] += 1

    def unfinished_requests(self) -> int:
        return sum(len(e.requests) for e in self.engines + self.decode_engines)

    # Completion ---------------------------------------------------------------------------------

    def _finished(self, r: SimRequest) -> None:
        now = self.loop.now_s
        assert r.first_token_s is not None
        self.metrics.add_request(
            RequestRecord(
                arrival_s=r.arrival_s,
                first_token_s=r.first_token_s,
                finish_s=now,
                prompt_tokens=r.prompt_tokens,
                output_tokens=r.output_tokens,
                hit_tokens=PerTier(*r.hit_tokens),
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
        self.arrivals.finished(r.req_id, now)

    def _prefill_done(self, r: SimRequest) -> None:
        """P/D: the prefill engine hands the request (and its KV) to a decode engine."""
        prefill_engine = next(e for e in self.engines if r.req_id in e.requests)
        prefill_engine.hand_off(r)
        if r.generated_tokens >= r.output_tokens:
            self._finished(r)
            return
        decode = self.decode_engines[least_loaded(self.loads(Role.DECODE))]
        # The prompt's KV on all the prefill engine's GPUs, each part over its GPU's compute NIC.
        per_token = engine_kv_bytes_per_token(prefill_engine.cost, prefill_engine.config.tp)
        nbytes = r.prompt_tokens * per_token
        if self.pd_link is None:
            raise SimError("a P/D cluster needs a pd_link for the KV transfer")

        def arrived(_t: Transfer) -> None:
            r.phase = Phase.RUNNING
            decode.accept_decode(r)

        self.pd_link.submit(nbytes, Direction.OUT, arrived, segment_bytes=nbytes, priority=1)


def _load(e: Engine) -> int:
    """Outstanding work of an engine, in tokens (prompt left to compute plus running requests)."""
    return e.waiting_prompt_tokens + len(e.running) + len(e.fetching)
