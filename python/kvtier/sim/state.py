"""Per-request state inside a simulated engine (never shown to policies: they get RequestViews)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.radix.watch import Watch
from kvtier.sched.base import Phase, RequestView
from kvtier.sim.request import Request


@dataclass(eq=False, slots=True)
class SimRequest:
    req: Request
    phase: Phase = Phase.WAITING
    computed_tokens: int = 0  # prompt tokens whose KV is on the device
    generated_tokens: int = 0
    locked_blocks: int = 0  # leading prompt blocks resident on device and locked for this request
    private_blocks: int = 0  # device blocks outside the prefix index (partial tails, decode tokens)
    reserved_blocks: int = 0  # device blocks set aside for a load or fetch in flight
    hit_tokens: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    matched_blocks: int | None = None  # prefix blocks present in any tier at first admission
    admitted: bool = False
    preempted: bool = False
    first_token_s: float | None = None
    last_token_s: float = 0.0
    max_tbt_s: float = 0.0
    pending_load_tokens: int = 0  # loaded this step (sync/layerwise), counted at step end
    epoch: int = 0  # bumped on preemption or swap-out: work planned before it no longer applies
    queue_marked: bool = False  # its blocks carry an in-queue mark (waiting)
    flight_marked: bool = False  # blocks [locked_blocks:] carry an in-flight mark (being computed/loaded)
    prefetching: bool = False  # an SSD/remote → host prefetch is in flight
    swap_pending: bool = False  # a swap-out or swap-in transfer is in flight
    swapped_blocks: int = 0  # host blocks holding this request's swapped-out KV
    # Eager block rotation (SwapCopy.eager): full blocks whose host copy was issued / has landed.
    host_copied_blocks: int = 0
    host_synced_blocks: int = 0
    view: RequestView | None = None  # its last view while admitted (kvtier.sim.view.admitted_view)
    # While waiting: its last view and the watch on the prefix-tree reads behind it (kvtier.sim.view.
    # waiting_view); the view is kept while the watch is valid.
    waiting_view: RequestView | None = None
    watch: Watch | None = None
    # req's fields, copied once: read on every step of every running request.
    req_id: int = field(init=False)
    arrival_s: float = field(init=False)
    keys: tuple[int, ...] = field(init=False)  # req.block_keys
    prompt_tokens: int = field(init=False)
    output_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        req = self.req
        self.req_id, self.arrival_s, self.keys = req.req_id, req.arrival_s, req.block_keys
        self.prompt_tokens, self.output_tokens = req.prompt_tokens, req.output_tokens

    @property
    def prefill_done(self) -> bool:
        return self.computed_tokens >= self.prompt_tokens
