"""``composed``: the four papers' scheduling pieces in one policy (what none of the papers has).

The policy is a list of stages (``stages: [rotation, async_fetch, balance]``, the default). Each
stage's decision comes from one paper, through that paper's own code (nothing is re-implemented here):

==============  ===========================================  ======================================
stage           decision                                      paper, code reused
==============  ===========================================  ======================================
``rotation``    who is swapped out / in this iteration, and  SuperInfer §4.2 (RotaSched: VLT, LVF
                which waiting requests may be admitted, in   Algorithm 1, B_xfer) and §4.3
                Largest-VLT-First order; the running         (DuplexKV as the swap copy):
                batch's block claims (no recompute           :meth:`RotaSched.rotate`,
                preemption); swaps moved by DuplexKV         :class:`StepPlan`; DuplexKV is the
                (the sim config's ``swap`` section)          data plane's, not a stage's
``async_fetch`` a waiting request whose prefix sits in the   ShadowServe §4.1-4.3 (batch
                store below host (SSD, remote) is            interception, SmartNIC chunked
                intercepted into the fetching queue (serial  pipeline): :meth:`ShadowServeAsync.
                FIFO) and fetched compressed through the     intercept`, ``fetch_order`` (the
                SmartNIC pipeline (the ``fetch`` section);   SmartNIC is the data plane's)
                the batch never waits on the store
``balance``     which of the remaining waiting requests      Strata §4.2-4.3: delay-hit deferral,
                join the prefill batch: deferral on delay    Algorithm 1, bubble filling, GPU-
                hits, Algorithm 1's load/compute balance,    assisted I/O, storage prefetch:
                bubble filling (async loads when loading-    :class:`Strata` run on the view that
                bound), GPU-assisted I/O, storage→host       the pieces above leave
                prefetch while queueing
``async_load``  instead of ``balance``: async loading       Unified KV pooling §II-B2:
                during queueing (:func:`admit_async`)        :func:`admit_async`
==============  ===========================================  ======================================

One iteration, in this order: (1) ``rotation`` runs LVF on the full view and plans the running
batch and the swap-ins (without it: the running batch as every kvtier policy, FCFS queue order);
(2) ``async_fetch`` intercepts store hits among the waiting requests rotation lets in; (3) the rest
is admitted by ``balance`` (Strata on a *sub-view*: only the admissible waiting requests, the free
blocks and running slots left by (1)-(2)), else by ``async_load``, else FCFS with layerwise loads
(HiCache-like). With only ``balance`` the decisions are Strata's (the sub-view is the view).

The unified pool's storage (one tier over every DRAM module and SSD, Algorithm 1 placement,
KV-passthrough) is not a stage: it is the sim config's ``pool`` section (``layout: pooled``,
``passthrough: true``; kvtier.sim.pool). The four booleans of earlier releases (``rotation``,
``async_fetch``, ``balance``, ``pool``) work for one release with a DeprecationWarning naming the
stages; a ``composed`` config without ``stages`` still fills the pooled layout where its ``pool``
section leaves it out, as ``pool: true`` (the old default) did (kvtier.sim.config.resolve_deprecated).

KV below the device is written through to every lower tier (Strata §4.1, LMCache), so the
host/SSD/remote tiers hold prefixes for later hits; rotary (swapped-out) requests share the host
tier with them.

Where composition does not help (measured: docs/reproduction.md, "Beyond the papers"): LVF admits
a waiting request only once it has lagged beta_F x the TTFT SLO and only if its whole prompt fits
B_HBM + B_xfer, which SuperInfer sized for short ShareGPT prompts; with 15K-30K-token prompts this
holds admissions back and rotations of multi-GB requests cost TBT, so ``rotation`` lowers TTFT and
TBT attainment on both workloads. ``async_fetch`` has nothing to do on the pooled layout (the pool
is the host tier and absorbs the SSDs) or when host and SSD hold the working set (remote is never
the nearest copy). With ample HBM no piece has anything to do.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from kvtier.errors import ConfigError
from kvtier.sched.base import (
    Policy,
    RequestView,
    SchedulerDecision,
    SchedulerView,
    register,
)
from kvtier.sched.batching import admit_fcfs, blocks_for, schedule_running
from kvtier.sched.members import DEVICE, LAYERWISE, REMOTE, SSD, SWAPPED, WAITING
from kvtier.sched.rotasched import RotaSched
from kvtier.sched.shadowserve import ShadowServeAsync
from kvtier.sched.step_plan import StepPlan
from kvtier.sched.strata import DEFER_THRESHOLD_TOKENS, Strata
from kvtier.sched.unified_pool import admit_async
from kvtier.sched.view_fill import sub_view

#: The stages, in the order they run; admission is by at most one of balance, async_load.
STAGES = ("rotation", "async_fetch", "balance", "async_load")
DEFAULT_STAGES = ("rotation", "async_fetch", "balance")
#: The booleans of earlier releases (deprecated): one per piece; ``pool`` on meant async_load
#: admission where balance is off (its pooled layout is the sim config's ``pool`` section now).
PIECES = ("rotation", "async_fetch", "balance", "pool")


def stages_from_pieces(rotation: bool, async_fetch: bool, balance: bool, pool: bool) -> tuple[str, ...]:
    """The stages the old four booleans meant."""
    on = {"rotation": rotation, "async_fetch": async_fetch, "balance": balance}
    return (*(p for p in DEFAULT_STAGES if on[p]), *(("async_load",) if pool and not balance else ()))


def check_stages(stages: Sequence[str]) -> tuple[str, ...]:
    """``stages`` as a tuple; unknown, repeated or out-of-order stages and two admission stages
    raise :class:`ConfigError`."""
    if isinstance(stages, str) or not all(isinstance(x, str) for x in stages):
        raise ConfigError(f"composed `stages` is {stages!r}; expected a list of {list(STAGES)}")
    unknown = [x for x in stages if x not in STAGES]
    if unknown:
        raise ConfigError(f"composed: unknown stage(s) {unknown}; expected some of {list(STAGES)}")
    if list(stages) != sorted(set(stages), key=STAGES.index):
        raise ConfigError(f"composed `stages` {list(stages)}: each at most once, in the order {list(STAGES)}")
    if "balance" in stages and "async_load" in stages:
        raise ConfigError("composed: stages `balance` and `async_load` both admit; give one of them")
    return tuple(stages)


@register
class Composed(Policy):
    """Strata + RotaSched/DuplexKV + ShadowServe async fetch + unified pool admission, as stages."""

    name = "composed"
    takes_xfer_blocks = True

    def __init__(
        self,
        stages: Sequence[str] | None = None,
        ttft_slo_s: float = 5.0,
        tbt_slo_s: float = 0.1,
        xfer_blocks: int | None = None,
        fetch_min_tokens: int = DEFER_THRESHOLD_TOKENS,
        strata: dict[str, Any] | None = None,
        rotasched: dict[str, Any] | None = None,
        rotation: bool | None = None,
        async_fetch: bool | None = None,
        balance: bool | None = None,
        pool: bool | None = None,
    ) -> None:
        if fetch_min_tokens < 0:
            raise ConfigError(f"composed fetch_min_tokens is {fetch_min_tokens}; expected >= 0")
        given = {"rotation": rotation, "async_fetch": async_fetch, "balance": balance, "pool": pool}
        legacy = {k: v for k, v in given.items() if v is not None}
        if legacy:
            if stages is not None:
                raise ConfigError(f"composed: give `stages` or the deprecated {sorted(legacy)}, not both")
            stages = stages_from_pieces(**{p: legacy.get(p, True) for p in PIECES})
            warnings.warn(
                f"composed {sorted(legacy)} are deprecated: use stages: {list(stages)}"
                + (" (and the sim config's pool.layout for the pooled storage)" if "pool" in legacy else ""),
                DeprecationWarning,
                stacklevel=2,
            )
        self.stages = check_stages(DEFAULT_STAGES if stages is None else stages)
        self.fetch_min_tokens = fetch_min_tokens
        self.strata_params = dict(strata or {})
        self.rotasched_params = dict(rotasched or {})
        try:
            self.strata = Strata(**self.strata_params)
            self.rota = RotaSched(
                ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s, xfer_blocks=xfer_blocks, **self.rotasched_params
            )
        except TypeError as e:
            raise ConfigError(f"composed: bad strata/rotasched parameters: {e}") from None
        self.shadow = ShadowServeAsync()
        self.rotation = "rotation" in self.stages
        self.intercepted_total = 0  # requests sent to the fetching queue by async_fetch

    def params(self) -> dict[str, Any]:
        return {
            "stages": list(self.stages),
            "ttft_slo_s": self.rota.ttft_slo_s,
            "tbt_slo_s": self.rota.tbt_slo_s,
            "xfer_blocks": self.rota.xfer_blocks,
            "fetch_min_tokens": self.fetch_min_tokens,
            "strata": self.strata_params,
            "rotasched": self.rotasched_params,
        }

    # ------------------------------------------------------------------------------------------

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        decision, sub = self._rotate(view) if self.rotation else self._plain(view)
        if "async_fetch" in self.stages:
            sub = self._intercept(sub, decision)
        self._admit(sub, decision)
        d = decision
        if (
            self.rotation
            and view.running
            and not (d.prefill or d.decode or d.loads or d.swap_in or d.swap_out)
        ):
            # The stall path (RotaSched.unstall: passive preemption, SuperInfer §4.2.1, §5): nothing
            # fits and LVF preempts no one; swap out from L's tail, the next iteration plans the rest
            # (the copies' landing starts it). Victims host cannot hold are preempted by recompute,
            # which lands nothing: this iteration runs the batch they leave.
            victims, dropped = self.rota.unstall(view)
            released = self.rota.swap_out(view, victims)
            if dropped:
                return self.rota.plan(view, victims, (), released, dropped)
            d.swap_out.extend(r.req_id for r in victims)
        return decision

    def steady_decode(self, view: SchedulerView) -> bool:
        # With rotation: RotaSched's steady view (nobody waiting, fetching or swapped, no swap-out in
        # flight, the claims within the margin) rotates no one and its plan decodes every running
        # request; async_fetch has no one to intercept (the fetch classes it keeps are empty after
        # this step) and admission no one to admit (Strata's steady view: its state stays the
        # arming step's). The stall path is not taken: the plan decodes.
        return self.rotation and self.rota.steady_decode(view)

    def _plain(self, view: SchedulerView) -> tuple[SchedulerDecision, SchedulerView]:
        """No rotation: the running batch first (every kvtier policy's order), queue order after."""
        return SchedulerDecision(), view

    def _rotate(self, view: SchedulerView) -> tuple[SchedulerDecision, SchedulerView]:
        """SuperInfer §4.2: LVF picks swap-outs and the requests it prioritises; the running batch
        and the swap-ins are planned as RotaSched plans them. Returns the decision so far and the
        sub-view left for admission: the prioritised waiting requests in LVF order, the running
        requests that stay, and the blocks and slots the plan leaves."""
        preempted, prioritised, released = self.rota.rotate(view)
        out = {r.req_id for r in preempted}
        plan = StepPlan(view, view.free_device_blocks + released, preempted)
        staying = tuple([r for r in view.running if r.req_id not in out] if out else view.running)
        plan.run(staying, self.rota.running_batch(view, preempted))
        swapped_in = 0
        for r in prioritised:
            if r.phase is SWAPPED and plan.swap_in(r):
                swapped_in += 1
        waiting = tuple(r for r in prioritised if r.phase is WAITING)
        sub = sub_view(
            view,
            waiting=waiting,
            running=staying,
            swapped=(),
            # plan.free_blocks has the staying requests' claims (unfinished prompts, a decode's
            # next block) and the swap-ins set aside: admission gets only what is left (B_HBM).
            free_device_blocks=max(plan.free_blocks, 0),
            max_running=max(view.max_running - swapped_in, 0),
            max_batch_tokens=view.max_batch_tokens,
        )
        return plan.decision, sub

    def _intercept(self, view: SchedulerView, decision: SchedulerDecision) -> SchedulerView:
        """ShadowServe §4.1: store (SSD/remote) hits go to the fetching queue through the
        SmartNIC pipeline (a prompt's whole blocks are held from interception on, as in the paper)."""
        self.shadow.forget_landed(view)
        free = view.free_device_blocks - len(view.running)  # ShadowServe's per-decode watermark
        slots = view.max_running - len(view.running) - len(view.fetching)
        kept: list[RequestView] = []
        taken = 0
        for r in view.waiting:
            stored = r.cached_tokens[SSD] + r.cached_tokens[REMOTE]  # SSD and remote: the store below host
            need = blocks_for(r.prompt_tokens, view.block_tokens) - blocks_for(
                r.cached_tokens[DEVICE], view.block_tokens
            )
            if stored > self.fetch_min_tokens and slots > 0 and need <= free:
                fetched = min(r.loadable_tokens, r.prompt_tokens - 1 - r.cached_tokens[DEVICE])
                decision.loads.append(self.shadow.intercept(r, fetched))
                free, slots, taken = free - need, slots - 1, taken + need
                self.intercepted_total += 1
                continue
            kept.append(r)
        return sub_view(
            view,
            waiting=tuple(kept),
            free_device_blocks=view.free_device_blocks - taken,
            max_running=view.max_running - (len(view.waiting) - len(kept)),
        )

    def _admit(self, view: SchedulerView, decision: SchedulerDecision) -> None:
        """Admission of the waiting requests the pieces above left: Strata on the sub-view, else
        the unified pool's async loading, else FCFS with layerwise loads."""
        if "balance" in self.stages:
            admitted = self.strata.schedule(view)
            if not self.rotation:  # the running batch is Strata's own (schedule_running)
                decision.decode.extend(admitted.decode)
                decision.prefill.extend(admitted.prefill)
            elif admitted.prefill:  # the plan holds the running batch's chunks: admissions only
                running = {r.req_id for r in view.running}
                decision.prefill.extend((rid, n) for rid, n in admitted.prefill if rid not in running)
            decision.loads.extend(admitted.loads)
            return
        if self.rotation:  # the plan holds the running batch: admit within what it leaves
            budget = view.max_batch_tokens - sum(n for _, n in decision.prefill) - len(decision.decode)
        else:
            budget = schedule_running(view, decision)
        admitted = SchedulerDecision()
        if "async_load" in self.stages:  # Unified pool §II-B2: fetch hits while queueing, no compute budget
            admit_async(view, admitted, budget)
        else:  # HiCache-like FCFS with layerwise loads
            admit_fcfs(view, admitted, budget, LAYERWISE, reserve_full_prompt=True)
        decision.prefill.extend(admitted.prefill)
        decision.loads.extend(admitted.loads)
