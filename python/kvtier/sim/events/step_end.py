"""The end of an engine step: a batch has computed (and its step-bound loads have landed).

Applies the step to its requests: loaded and computed prompt tokens, first tokens when a prefill
completes (TTFT), decode tokens (TBT), finished requests (JCT). Work planned for a request that was
preempted during the step (its ``epoch`` moved on) is discarded: it was wasted compute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.sched.base import LoadOrder
from kvtier.sched.members import RUNNING, SYNC
from kvtier.sim.core import EventKind, EventLoop
from kvtier.sim.cost import CostModel, PrefillChunk
from kvtier.sim.metrics import Metrics
from kvtier.sim.state import SimRequest
from kvtier.tiers import Tier


class StepEngine(Protocol):
    """What a step reads and calls of the engine that planned it (:class:`kvtier.sim.engine.Engine`),
    so that this module sits below the engine that imports it."""

    @property
    def loop(self) -> EventLoop: ...
    @property
    def cost(self) -> CostModel: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def on_prefill_done(self) -> Callable[[SimRequest], None] | None: ...
    def start_load_transfers(
        self, load: LoadOrder, blocks: list[tuple[int, Tier]], done: Callable[[], None]
    ) -> None: ...
    def land_load(
        self, r: SimRequest, start_block: int, blocks: list[tuple[int, Tier]], epoch: int
    ) -> bool: ...
    def commit_prefix(self, r: SimRequest) -> None: ...
    def finish(self, r: SimRequest) -> None: ...
    def end_step(self, step: Step) -> None: ...


@dataclass(eq=False)
class _Load:
    request: SimRequest
    order: LoadOrder
    blocks: list[tuple[int, Tier]]
    tokens: int
    start_block: int
    epoch: int


@dataclass(eq=False, slots=True)
class Step:
    engine: StepEngine
    start_s: float
    compute_s: float = 0.0
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    prefills: list[tuple[SimRequest, int, int]] = field(default_factory=list)  # (request, tokens, epoch)
    decodes: list[tuple[SimRequest, int]] = field(default_factory=list)  # (request, epoch)
    decode_contexts: list[int] = field(default_factory=list)
    loads: list[_Load] = field(default_factory=list)
    _pending_loads: int = 0

    def add_prefill(self, r: SimRequest, n: int, chunk: PrefillChunk) -> None:
        self.prefill_chunks.append(chunk)
        self.prefills.append((r, n, r.epoch))

    def add_decode(self, r: SimRequest, context_tokens: int) -> None:
        self.decodes.append((r, r.epoch))
        self.decode_contexts.append(context_tokens)

    def add_load(self, r: SimRequest, order: LoadOrder, blocks: list[tuple[int, Tier]], tokens: int) -> None:
        self.loads.append(_Load(r, order, blocks, tokens, r.locked_blocks, r.epoch))

    def empty(self) -> bool:
        return not self.prefills and not self.decodes and not self.loads

    def begin(self) -> None:
        """Starts the step's loads; the step ends once compute and loads allow (load modes)."""
        engine = self.engine
        if not self.loads:
            engine.loop.after(self.compute_s, EventKind.STEP_END, lambda: engine.end_step(self))
            return
        self._pending_loads = len(self.loads)
        for load in self.loads:
            engine.start_load_transfers(load.order, load.blocks, self._landed(load))

    def _landed(self, load: _Load) -> Callable[[], None]:
        def done() -> None:
            if self.engine.land_load(load.request, load.start_block, load.blocks, load.epoch):
                load.request.pending_load_tokens += load.tokens
            self._pending_loads -= 1
            if self._pending_loads == 0:
                self._loads_done()

        return done

    def _loads_done(self) -> None:
        engine = self.engine
        now = engine.loop.now_s
        compute_end = self.start_s + self.compute_s
        if any(load.order.mode is SYNC for load in self.loads):
            end = now + self.compute_s
        else:  # layerwise: the last layer computes after its KV lands
            end = max(compute_end, now + self.compute_s / max(engine.cost.num_layers, 1))
        engine.metrics.blocked_io_s += end - compute_end
        engine.loop.schedule(end, EventKind.STEP_END, lambda: engine.end_step(self))


def finish_step(engine: StepEngine, step: Step) -> None:
    now = engine.loop.now_s
    metrics = engine.metrics
    metrics.steps += 1
    metrics.busy_s += now - step.start_s
    for load in step.loads:  # loads of requests whose chunk was not computed still count
        r = load.request
        if load.epoch == r.epoch and r.pending_load_tokens:
            r.computed_tokens += r.pending_load_tokens
            r.pending_load_tokens = 0
            engine.commit_prefix(r)
    for r, n, epoch in step.prefills:
        if epoch != r.epoch or r.phase is not RUNNING:
            continue
        r.computed_tokens = min(r.computed_tokens + n, r.prompt_tokens)
        engine.commit_prefix(r)
        if not r.prefill_done:
            continue
        if r.first_token_s is None:
            r.first_token_s = now
            r.last_token_s = now
            r.generated_tokens = 1
        if engine.on_prefill_done is not None:
            engine.on_prefill_done(r)
        elif r.generated_tokens >= r.output_tokens:
            engine.finish(r)
    gaps: list[float] = []  # the token gaps, in this order, go into the TBT metrics after the loop
    add_gap, running = gaps.append, RUNNING
    for r, epoch in step.decodes:
        if epoch != r.epoch or r.phase is not running:
            continue
        gap = now - r.last_token_s
        add_gap(gap)
        if gap > r.max_tbt_s:  # max(r.max_tbt_s, gap)
            r.max_tbt_s = gap
        r.last_token_s = now
        r.generated_tokens = generated = r.generated_tokens + 1
        if generated >= r.output_tokens:
            engine.finish(r)
    if gaps:
        metrics.add_tbts(gaps)
