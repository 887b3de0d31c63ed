"""One engine of a node-group cluster (:mod:`kvtier.sim.dualpath`): a GPU with its requests, the
policy's view of them, and the mechanism the decision executor drives.

Each step an engine shows its policy a :class:`SchedulerView` and hands the decision to
:func:`kvtier.sched.executor.execute` with itself as the backend, as the simulated engine
(:class:`kvtier.sim.engine.Engine`) does: a prefill engine (PE) carries out prefill chunks, a decode
engine (DE) decodes. A request never leaves the engine it is placed on (no preemption or swap: a
DE's HBM is reserved when the global scheduler places it, §6.1), and its hit KV comes from storage
with the step (layerwise streaming, or before it), so every other order is a policy error and
raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.errors import SimError
from kvtier.sched.base import LoadOrder, Phase, Policy, RequestView, SchedulerView
from kvtier.sched.executor import execute
from kvtier.sched.placement import Role
from kvtier.sim.ep_cost import PrefillEstimates
from kvtier.sim.request import Request
from kvtier.sim.resources import Link
from kvtier.sim.topology import EngineSlot
from kvtier.tiers import PerTier


@dataclass(eq=False)
class GroupRequest:
    req: Request
    hit_tokens: int  # its previous turn's full blocks, in storage (DualPath App. A.4)
    pe: int = -1
    de: int = -1
    side: str = "pe"  # where its hit KV was read to: "pe" or "de" buffer
    computed_tokens: int = 0
    generated_tokens: int = 0
    first_token_s: float | None = None
    max_tbt_s: float = 0.0
    epoch: int = 0  # it never leaves its engine: the executor's epochs always hold

    @property
    def prompt_tokens(self) -> int:
        return self.req.prompt_tokens

    @property
    def req_id(self) -> int:
        return self.req.req_id

    @property
    def phase(self) -> Phase:
        return Phase.RUNNING if self.computed_tokens > self.hit_tokens else Phase.WAITING

    @property
    def prefill_done(self) -> bool:
        return self.computed_tokens >= self.prompt_tokens


@dataclass
class StepPlan:
    """What one engine's step computes: prefill chunks (a PE) or the requests decoded (a DE)."""

    prefill: list[tuple[GroupRequest, int]] = field(default_factory=list)
    decode: list[GroupRequest] = field(default_factory=list)


@dataclass(frozen=True)
class ViewShape:
    """What every engine of a cluster shows its policy besides its requests."""

    device_blocks: int  # blocks (layer blocks, with layerwise prefill) the batch's KV may take
    block_tokens: int
    num_layers: int
    kv_bytes_per_token: int
    estimates: PrefillEstimates
    layerwise_prefill: bool = True  # the cluster's `io` section (kvtier.sched.kv_io)


@dataclass(eq=False)
class GpuEngine:
    slot: EngineSlot
    role: Role
    policy: Policy
    requests: dict[int, GroupRequest]  # the cluster's, by id
    shape: ViewShape
    unfinished_requests: int = 0
    unfinished_tokens: int = 0
    queue: list[GroupRequest] = field(default_factory=list)  # PE: hit KV read; DE: running
    incoming: list[GroupRequest] = field(default_factory=list)  # DE: KV landed, joins next event
    free_hbm_tokens: int = 0  # DE: KV tokens its HBM still holds
    stepping: bool = False
    engine_id: int = field(init=False)

    def __post_init__(self) -> None:
        self.engine_id = self.slot.engine_id

    @property
    def cnic(self) -> Link:
        return self.slot.cnic

    def take(self, r: GroupRequest) -> None:
        self.unfinished_requests += 1
        self.unfinished_tokens += r.prompt_tokens

    def drop(self, r: GroupRequest) -> None:
        self.unfinished_requests -= 1
        self.unfinished_tokens -= r.prompt_tokens

    def plan(self, now_s: float) -> StepPlan:
        """The policy's decision for this step, carried out by the executor."""
        plan = StepPlan()
        execute(self.policy.schedule(self.view(now_s)), self, plan)
        return plan

    def view(self, now_s: float) -> SchedulerView:
        running: list[RequestView] = []
        waiting: list[RequestView] = []
        decode = self.role is Role.DECODE
        for r in self.queue:
            started = r.computed_tokens > r.hit_tokens  # r.phase, inlined: views are built per step
            view = RequestView(
                req_id=r.req.req_id,
                arrival_s=r.req.arrival_s,
                phase=Phase.RUNNING if started else Phase.WAITING,
                prompt_tokens=r.prompt_tokens,
                computed_tokens=r.computed_tokens if started else 0,
                generated_tokens=r.generated_tokens if decode else 0,
                cached_tokens=PerTier(host=0 if started else r.hit_tokens),
            )
            (running if started else waiting).append(view)
        s = self.shape
        return SchedulerView(
            now_s=now_s,
            waiting=tuple(waiting),
            running=tuple(running),
            fetching=(),
            swapped=(),
            free_device_blocks=s.device_blocks,
            free_host_blocks=None,
            block_tokens=s.block_tokens,
            max_batch_tokens=2**31,
            max_running=2**31,
            num_layers=s.num_layers,
            cost=s.estimates,
            kv_bytes_per_token=s.kv_bytes_per_token,
            layerwise_prefill=s.layerwise_prefill,
        )

    # The executor's backend ---------------------------------------------------------------------

    def error(self, message: str) -> SimError:
        return SimError(message)

    def find(self, req_id: int) -> GroupRequest | None:
        r = self.requests.get(req_id)
        return r if r is not None and self.engine_id in (r.pe, r.de) else None

    def _cannot(self, what: str, r: GroupRequest) -> None:
        raise SimError(
            f"policy {self.policy.name!r}: a {self.role.value} engine cannot {what} request {r.req_id}"
        )

    def preempt(self, r: GroupRequest) -> None:
        self._cannot("preempt", r)

    def swap_out(self, r: GroupRequest) -> None:
        self._cannot("swap out", r)

    def swap_in(self, r: GroupRequest) -> None:
        self._cannot("swap in", r)

    def end_swaps(self) -> None:
        pass

    def plan_prefill(self, plan: StepPlan, r: GroupRequest, tokens: int, load: LoadOrder | None) -> None:
        if self.role is not Role.PREFILL or r.pe != self.engine_id:
            self._cannot("prefill", r)
        if tokens > 0:  # its hit KV (``load``) streams in with the step
            plan.prefill.append((r, tokens))

    def plan_decode(self, plan: StepPlan, r: GroupRequest) -> None:
        if self.role is not Role.DECODE or r.de != self.engine_id:
            self._cannot("decode", r)
        plan.decode.append(r)

    def start_load(self, r: GroupRequest, load: LoadOrder) -> None:
        self._cannot("load outside a step", r)

    def prefetch(self, r: GroupRequest, load: LoadOrder) -> None:
        self._cannot("prefetch", r)
