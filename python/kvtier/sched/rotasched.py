"""``rotasched``: SuperInfer's RotaSched (§4.2), an SLO-aware rotary scheduler, with DuplexKV's
transfer model (§4.3) as the way its swaps move.

RotaSched preempts *proactively*: requests rotate between HBM (running) and host DRAM (the
*rotary* state, kvtier's ``Phase.SWAPPED``) by their **Virtual Lag Time** (§4.2.2)::

    VLT = alpha * ReLU(now - t_last - beta_B * S_B)   rotary  (t_last: its last token)
          ReLU(now - t_arr - beta_F * S_F)            waiting (t_arr: its arrival)
          -(now - t_run)                              running (t_run: when it began running)

S_B is the TBT SLO and S_F the TTFT SLO. (§4.2.2's sentence says the reverse, but its own
naming, the ablations of §5.3 — beta_F delays *new* requests, Fig. 19; beta_B delays *rotary*
ones, Fig. 20 — and the evaluation's beta_F = 0.5 only make sense this way: a waiting request
is tolerated for beta_F x 5 s, a rotary one for beta_B x 100 ms.)

Each iteration runs **Largest-VLT-First** exactly as Algorithm 1 (:func:`~kvtier.sched.lvf.lvf`): (1) if the free
blocks B_HBM hold every waiting and rotary request, fall back to FCFS; (2) sort all requests by VLT,
descending; (3) from the head, prioritise waiting/rotary requests with VLT >= 0 that fit in
B_HBM + B_xfer blocks left; (4) from the tail, swap out running requests with VLT < 0 until the
B_swap = B_xfer - B_left extra blocks are found. B_xfer, the transfer budget, bounds the blocks
rotated per iteration (§4.2.3: 2400 in §5.1, of P = 16 tokens: :data:`PAPER_XFER_TOKENS`). Left out,
it is those 38,400 tokens in the view's blocks (:func:`paper_xfer_blocks`; a count of blocks read
at another block size would move 32x the bytes at 512-token blocks); the simulator gives the node's
own, the blocks its host link moves in the time C2C moves §5.1's (:mod:`kvtier.sim.xfer`).

Policy state (kvtier adaptation): the view carries arrival, phase and token counts but not t_last or
t_run, so the policy records them from successive views: t_last is the first view in which a
request's ``generated_tokens`` grew (a view is shown right when a step ends: the token's time);
t_run the first view showing it running. A swap-in lands between iterations, so a request selected
in iteration t first runs in t+1 (in vLLM, in t); t_run is taken then, so its VLT is 0 and it
decodes once before it can be preempted again (t_run at selection rotated requests back out before
their first decode: a livelock). Where that leaves LVF nobody to preempt and nothing runs, vLLM's
passive preemption steps in (:meth:`RotaSched.unstall`).

Host room: vLLM swaps a request out only if ``can_swap_out`` (its swap space holds it), and a
rotation is meant to keep the victim's KV (§4.2.1: proactive preemption by swapping). So step 4 takes
only victims the host room left can hold (``SchedulerView.free_host_blocks``: swap space free, or
held by prefix cache that gives way) and never orders a swap-out the engine would turn into a
recompute. Where device and host are both full and the running batch needs blocks, the stall path
preempts by recompute (vLLM's passive preemption) the victims host cannot hold.

B_HBM: the view's free device blocks less what the running batch already claims (the rest of a
chunked prompt, the new block a decode crossing a block boundary needs), so admissions never push
the engine into its passive recompute preemption; plus the blocks of earlier swap-outs whose copy
is still in flight (already rotated out; counting them as used would preempt twice for one need).

DuplexKV (§4.3) is the engine's swap path (:class:`~kvtier.sched.swap_copy.SwapCopy`): data-plane
config (the sim config's ``swap: {engine: ...}``; where it names none, ``duplexkv``, the engine
RotaSched was evaluated on: :mod:`kvtier.sched.data_plane`), among Table 1's ladder (:data:`~kvtier.sched.swap_copy.SWAP_ENGINES`): Naive (vLLM's copies: one per 64 KB
layer segment), MS (block-first layout: one copy per 4 MB block), MS+MK (one batched launch per
direction), DuplexKV (MS+MK with eager block rotation, so full duplex). All four run in the
cross-iteration pipeline (Fig. 15: an iteration's swaps overlap its compute; the next iteration
starts once both are done). The first three run their copies one at a time (a swap-in may reuse the
blocks a swap-out frees: data race, Fig. 13 left) and free a victim's blocks only when its copy
lands; under DuplexKV a swap-out moves only the dirty tail block, so the victims' synced blocks
serve this very iteration's prioritised requests. ``vllm`` is vLLM's own swap (Naive copies run
before the forward pass), the path of the §3.1 static policies.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvtier.errors import ConfigError
from kvtier.sched.base import (
    Phase,
    Policy,
    RequestView,
    SchedulerDecision,
    SchedulerView,
    register,
)
from kvtier.sched.batching import steady_fcfs
from kvtier.sched.claims import claim, kv_blocks, released_now, running_claims
from kvtier.sched.lvf import Entry, Head, RotarySet, fcfs_key, take_heads, take_tails
from kvtier.sched.members import DEVICE, RUNNING, SWAPPED, WAITING
from kvtier.sched.rota_seen import RunningPass, Seen, visit_running
from kvtier.sched.step_plan import RunningBatch, StepPlan

#: SuperInfer §5.1's transfer budget: 2400 blocks of P = 16 tokens (§4.3.1) per iteration.
PAPER_XFER_BLOCKS, PAPER_BLOCK_TOKENS = 2400, 16
PAPER_XFER_TOKENS = PAPER_XFER_BLOCKS * PAPER_BLOCK_TOKENS


def paper_xfer_blocks(block_tokens: int) -> int:
    """§5.1's budget, the same 38,400 tokens, in blocks of ``block_tokens`` (at least one)."""
    return max(1, PAPER_XFER_TOKENS // block_tokens)


_FORGET_S = 30.0  # a request unseen this long has left (finished); its records go


Requests = Sequence[RequestView]


@register
class RotaSched(Policy):
    """RotaSched + DuplexKV. SLOs and the §4.2.2 coefficients are parameters (§5.1's defaults)."""

    name = "rotasched"
    takes_xfer_blocks = True

    def __init__(
        self,
        ttft_slo_s: float = 5.0,
        tbt_slo_s: float = 0.1,
        alpha: float = 3.0,
        beta_b: float = 0.0,
        beta_f: float = 0.5,
        xfer_blocks: int | None = None,
    ) -> None:
        if not (ttft_slo_s > 0 and tbt_slo_s > 0):
            raise ConfigError(f"rotasched SLOs must be > 0; got ttft {ttft_slo_s}, tbt {tbt_slo_s}")
        if not (alpha >= 0 and math.isfinite(beta_b) and math.isfinite(beta_f)):
            raise ConfigError(f"rotasched needs alpha >= 0 and finite betas; got {alpha}, {beta_b}, {beta_f}")
        if xfer_blocks is not None and (
            isinstance(xfer_blocks, bool) or not isinstance(xfer_blocks, int) or xfer_blocks < 0
        ):
            raise ConfigError(f"rotasched xfer_blocks is {xfer_blocks!r}; expected a whole number >= 0")
        self.ttft_slo_s = ttft_slo_s
        self.tbt_slo_s = tbt_slo_s
        self.alpha = alpha
        self.beta_b = beta_b
        self.beta_f = beta_f
        self.xfer_blocks = xfer_blocks  # None: paper_xfer_blocks of the view's block size
        self._seen: OrderedDict[int, Seen] = OrderedDict()  # in order of last sight
        # Swapped out, copy not landed yet: (device blocks still held, when) per request.
        self._pending_out: dict[int, tuple[int, float]] = {}
        self._steady = False  # steady_decode said yes: steps up to the next view may go unseen
        self._rotary = RotarySet()  # the rotary requests of the last view, in t_last order
        self._waiting = RotarySet(WAITING)  # the waiting head of the last view, by arrival
        self._last_now = -math.inf  # the time of the last view observed
        self._views = 0  # views observed
        self._use_rotary = False  # the rotary set is kept (_keep_rotary)
        self._swap_rate = 0.0  # swap-outs per iteration, a moving average
        self._batch: tuple[SchedulerView, RunningBatch] | None = None  # read in rotate's visit

    def params(self) -> dict[str, Any]:
        return {
            "ttft_slo_s": self.ttft_slo_s,
            "tbt_slo_s": self.tbt_slo_s,
            "alpha": self.alpha,
            "beta_b": self.beta_b,
            "beta_f": self.beta_f,
            "xfer_blocks": self.xfer_blocks,
        }

    # ------------------------------------------------------------------------------------------
    # VLT (§4.2.2)

    def vlt(self, r: RequestView, now_s: float) -> float:
        seen = self._seen.get(r.req_id)
        if r.phase is SWAPPED:
            last_s = seen.last_token_s if seen is not None else r.arrival_s
            return self.alpha * max(0.0, now_s - last_s - self.beta_b * self.tbt_slo_s)
        if r.phase is RUNNING:
            start_s = seen.run_start_s if seen is not None else now_s
            return -(now_s - start_s)
        return max(0.0, now_s - r.arrival_s - self.beta_f * self.ttft_slo_s)

    def observe(self, view: SchedulerView) -> None:
        """Updates t_last and t_run from this view; forgets requests unseen for a while."""
        self._observe(view)

    def _observe(self, view: SchedulerView) -> RunningPass | None:
        """:meth:`observe`, returning what :meth:`rotate` reads of the running requests, taken in
        the same visit (:func:`~kvtier.sched.rota_seen.visit_running`); None where a request was
        visited twice in this view (shown twice, or in two groups), as its keys may then be stale:
        rotate reads them again.

        The rotary set (:class:`~kvtier.sched.lvf.RotarySet`) and the waiting head (kept the same
        way) are updated by what changed since the last view: a member whose view object is the
        one seen last time is not visited (its phase, tokens and t_last are as recorded). Its
        record's last sight (``seen_s``, and ``prev_tokens``, which only a running request's reading
        needs) is brought up to date when it leaves the set, or when forgetting reaches it while it
        is still there.
        ``_seen`` is kept in order of that last sight (a request seen moves to the end), so the
        requests to forget are a run at its head: no scan of every remembered request per step,
        and the records forgotten are those unseen for ``_FORGET_S`` at this view, as when every
        request was visited every view."""
        now, last = view.now_s, self._last_now
        self._views += 1
        seen_map, pending_out, rotary = self._seen, self._pending_out, self._rotary
        running = RUNNING
        if self._steady:
            self._steady = False
            self._skipped(view)
        shown = view.swapped
        kept = self._keep_rotary(len(shown))
        fresh: Sequence[RequestView] = ()
        gone: list[int] = []
        if shown is not rotary.shown and (kept or rotary.entries):
            fresh, gone = rotary.diff(shown)
            self._settle(rotary, gone, last)
        waiting, head = self._waiting, tuple(view.waiting)  # the same views, a new sequence each view
        head_fresh, head_gone = waiting.diff(head) if head or waiting.entries else ((), [])
        self._settle(waiting, head_gone, last)
        passed = visit_running(view, seen_map, pending_out)
        for group in (fresh if kept else shown, head_fresh, view.fetching):
            for r in group:
                rid = r.req_id
                if rid in pending_out:  # visible again: its swap-out copy has landed
                    del pending_out[rid]
                seen = seen_map.get(rid)
                if seen is None:
                    last_s = now if r.generated_tokens else r.arrival_s
                    tokens = r.computed_tokens + r.generated_tokens
                    seen_map[rid] = Seen(r.phase, r.generated_tokens, tokens, 0, last_s, now, now, r)
                    continue
                if seen.seen_s == now:  # visited already in this view (or settled at the same time)
                    passed = None
                seen_map.move_to_end(rid)
                if seen.view is r:  # the very view seen last time: phase and tokens as recorded
                    seen.seen_s, seen.prev_tokens = now, seen.tokens
                    continue
                seen.view, tokens = r, r.computed_tokens + r.generated_tokens
                if r.generated_tokens > seen.generated:
                    seen.last_token_s = now
                if r.phase is running and seen.phase is not running:
                    seen.run_start_s = now
                seen.phase, seen.generated, seen.seen_s = r.phase, r.generated_tokens, now
                seen.prev_tokens, seen.tokens = seen.tokens, tokens
        if not kept:
            if rotary.entries:  # members seen now were visited above, those gone settled
                rotary = self._rotary = RotarySet()
        elif shown is not rotary.shown:
            rotary.update(shown, gone, [self._entry(r, view.block_tokens) for r in fresh])
        if head_fresh or head_gone:
            bt, n = view.block_tokens, self._views
            waiting.update(
                head,
                head_gone,
                [(r.arrival_s, r.arrival_s, r.req_id, kv_blocks(r, bt), r, n) for r in head_fresh],
            )
        members, head_members = rotary.entries, waiting.entries  # (RotarySet.__contains__, inline)
        while seen_map:
            rid = next(iter(seen_map))
            seen = seen_map[rid]
            if not now - seen.seen_s > _FORGET_S:
                break
            if rid in members or rid in head_members:  # a member, seen in this view (and when it entered)
                seen.seen_s, seen.prev_tokens = now, seen.tokens
                seen_map.move_to_end(rid)
            else:
                del seen_map[rid]
        for rid in [
            rid
            for rid, (_, t) in pending_out.items()
            if now - t > _FORGET_S or rid in members or rid in head_members
        ]:
            del pending_out[rid]  # forgotten, or a member shown (not visited above): its copy landed
        self._last_now = now
        return passed

    def _settle(self, kept: RotarySet, gone: Sequence[int], last_s: float) -> None:
        """The records of ``kept``'s members ``gone`` (not shown as they were): in the set at the
        previous view, so seen then, unchanged since they entered."""
        seen_map, entries = self._seen, kept.entries
        for rid in gone:
            if (s := seen_map.get(rid)) is not None:
                if entries[rid][5] < self._views - 1:  # seen at two views or more: as the
                    s.prev_tokens = s.tokens  # same-view path would have left it
                s.seen_s = last_s
                seen_map.move_to_end(rid)

    # The rotary set pays where many rotary requests wait and few change per view (SuperInfer's
    # RotaSched on an overloaded engine: ~345 rotary, ~2 swaps a step); where most of them change
    # each view (the composed policy there: ~54 rotary, ~25 swapped out a step), visiting each is
    # cheaper. Kept from ``_rotary_base + _rotary_per_swap`` x the recent swap-outs per view up,
    # dropped below half that. Either way the decisions are the same.
    _rotary_base = 64
    _rotary_per_swap = 8.0

    def _keep_rotary(self, rotary: int) -> bool:
        at = self._rotary_base + self._rotary_per_swap * self._swap_rate
        self._use_rotary = rotary >= (at / 2 if self._use_rotary else at)
        return self._use_rotary

    def _entry(self, r: RequestView, block_tokens: int) -> Entry:
        """A rotary request's place in the set: (t_last, arrival, id, blk(r), view, this view's number)."""
        last_s = self._seen[r.req_id].last_token_s
        return (last_s, r.arrival_s, r.req_id, kv_blocks(r, block_tokens), r, self._views)

    def steady_decode(self, view: SchedulerView) -> bool:
        """Nobody waiting, fetching or swapped (:func:`steady_fcfs`), no swap-out in flight and the
        claims within the free blocks: no contention (step 1), so no rotation, and :meth:`plan`
        decodes every running request. Later views differ in time (running VLTs, which the FCFS
        fallback does not read) and tokens, bounded as ``static_swap._StaticSwap._steady`` bounds
        them; what the views not shown would have changed is made up at the next one (_skipped)."""
        if self._pending_out or not steady_fcfs(view) or any(r.generated_tokens < 1 for r in view.running):
            return False
        self._steady = running_claims(view) + len(view.running) <= view.free_device_blocks
        return self._steady

    def _skipped(self, view: SchedulerView) -> None:
        """The first view after :meth:`steady_decode` said yes; the steps since may have gone
        unseen (decode fast-forward), each decoding every running request and nothing else. A
        request running now and at the last view seen decoded in the step before: that step's view
        would have recorded ``tokens - 1`` (``prev_tokens`` below); every other field it would set,
        this view sets again. Records of requests that finished meanwhile are forgotten sooner."""
        for r in view.running:
            seen = self._seen.get(r.req_id)
            if seen is not None and seen.phase is RUNNING and seen.view is not r:
                tokens = r.computed_tokens + r.generated_tokens
                if tokens > seen.tokens:
                    seen.tokens = tokens - 1

    def synced_blocks(self, r: RequestView, block_tokens: int) -> int:
        """Blocks full at the previous view: their eager host copy started then (§4.3.2). A member
        of a kept set shown as it was (a running request shown there: not where a simulator shows
        one) was not visited: its record's ``prev_tokens`` is that of an earlier view, and this
        view's same-view path would have made it its tokens."""
        seen = self._seen.get(r.req_id)
        if seen is None:
            return 0
        for kept in (self._rotary, self._waiting):
            entry = kept.entries.get(r.req_id)
            if entry is not None and entry[4] is r and entry[5] < self._views:
                return seen.tokens // block_tokens
        return seen.prev_tokens // block_tokens

    # ------------------------------------------------------------------------------------------
    # One iteration

    def rotate(self, view: SchedulerView) -> tuple[list[RequestView], list[RequestView], int]:
        """One iteration's rotation: observes ``view``, runs LVF and records the swap-outs.

        Returns (preempted P, prioritised R, device blocks the swap-outs free for this iteration).
        Algorithm 1 as :func:`~kvtier.sched.lvf.lvf` runs it, with the rotary and waiting requests
        read from their kept sets (in step 2's order already, blk(r) summed) instead of one by one.
        """
        passed = self._observe(view)
        now, bt = view.now_s, view.block_tokens
        seen_map = self._seen  # observe() saw every request below
        rotary = self._rotary
        kept = self._use_rotary and not rotary.odd  # the set holds every rotary request, in LVF's order
        # The waiting head's set beside it (merged with the rotary set's order in step 3), if it too
        # holds every waiting request where a simulator shows it.
        head = self._waiting if kept and not self._waiting.odd else None
        # blk(r) (kv_blocks), VLT (vlt), LVF's keys and the running batch's claims (running_claims)
        # in one pass over the running and waiting requests: each key goes to the group LVF takes
        # it from.
        heads: list[Head] = []  # waiting (and rotary, if not kept), VLT >= 0: step 3's
        contended = rotary.total if kept else 0  # blocks of every waiting and rotary request (step 1)
        contended += head.total if head is not None else 0
        running, waiting, swapped, device = RUNNING, WAITING, SWAPPED, DEVICE
        groups: tuple[tuple[Sequence[RequestView], Phase], ...]
        if passed is not None:  # the running requests read in observe's visit; those not running here
            tails, batch, odd = passed
            claims, groups, self._batch = batch.claims, ((odd, running),), (view, batch)
        else:
            tails, claims, groups, self._batch = [], running_claims(view), ((view.running, running),), None
        wait_s = self.beta_f * self.ttft_slo_s
        alpha, lag_s = self.alpha, self.beta_b * self.tbt_slo_s
        if head is None:
            groups += ((view.waiting, waiting),)
        if not kept:
            groups += ((view.swapped, swapped),)
        for group, phase in groups:
            for r in group:
                if r.phase is not phase:  # not where a simulator shows it: the general path
                    need, vlt, phase_r = kv_blocks(r, bt), self.vlt(r, now), r.phase
                elif phase is waiting:  # max(0.0, x) as a test: the same float, -0.0 and NaN included
                    need = -(-r.prompt_tokens // bt) - r.cached_tokens[device] // bt
                    vlt = now - r.arrival_s - wait_s
                    vlt, phase_r = vlt if vlt > 0.0 else 0.0, phase
                elif phase is running:
                    need = -(-(r.computed_tokens + r.generated_tokens) // bt)
                    vlt, phase_r = -(now - seen_map[r.req_id].run_start_s), phase
                else:
                    need = -(-(r.computed_tokens + r.generated_tokens) // bt)
                    lag = now - seen_map[r.req_id].last_token_s - lag_s
                    vlt, phase_r = alpha * (lag if lag > 0.0 else 0.0), phase
                if phase_r is not running:
                    contended += need
                    if vlt >= 0:
                        heads.append(((-vlt, r.arrival_s, r.req_id), need, r))
                elif vlt < 0:
                    tails.append(((-vlt, r.arrival_s, r.req_id), need, r))
        # B_HBM: free blocks less the running batch's claims, plus those of earlier swap-outs still
        # copying (already rotated out: counting them again would preempt twice for one need).
        pending = sum(held for held, _ in self._pending_out.values())
        free_hbm = view.free_device_blocks - claims + pending
        if free_hbm >= contended:  # lvf's step 1: no contention, FCFS
            waiting_rotary = [*(view.swapped if kept else ()), *(view.waiting if head is not None else ())]
            waiting_rotary += [r for group, _ in groups for r in group if r.phase is not running]
            return [], sorted(waiting_rotary, key=fcfs_key), 0
        heads.sort()  # step 2 (the rotary set is in its order); unique keys: nothing else compared
        xfer = self.xfer_blocks if self.xfer_blocks is not None else paper_xfer_blocks(bt)
        left = free_hbm + xfer  # step 3: B_left
        if not kept:
            prioritised, left = take_heads(heads, left)
        else:
            prioritised, left = take_heads(heads, left, rotary, now, alpha, lag_s, head, wait_s)
        preempted = take_tails(tails, xfer - left, view.free_host_blocks)  # step 4
        return preempted, prioritised, self.swap_out(view, preempted)

    def swap_out(self, view: SchedulerView, preempted: Sequence[RequestView]) -> int:
        """Records ``preempted``'s swap-outs; returns the device blocks they free for this iteration."""
        released, bt = 0, view.block_tokens
        self._swap_rate += (len(preempted) - self._swap_rate) / 16
        for r in preempted:
            now_free = released_now(r, view.swap_copy, self.synced_blocks(r, bt), bt)
            released += now_free
            self._pending_out[r.req_id] = (kv_blocks(r, bt) - now_free, view.now_s)
        return released

    def running_batch(self, view: SchedulerView, out: Sequence[RequestView]) -> RunningBatch | None:
        """The :class:`~kvtier.sched.step_plan.RunningBatch` of ``view``'s running requests less
        ``out``, where :meth:`rotate` read it for this very view (None where it did not)."""
        if self._batch is None or self._batch[0] is not view:
            return None
        return self._batch[1].without(out, view.block_tokens)

    def unstall(self, view: SchedulerView) -> tuple[list[RequestView], list[RequestView]]:
        """Running requests to swap out, and to preempt by recompute, where the iteration would plan
        nothing (the stall path).

        Algorithm 1's step 4 takes only VLT < 0, so no request in the iteration it lands in: if all
        are that new and their claims exceed the free blocks (B_HBM < 0), nothing is planned and
        nothing in flight frees a block. SuperInfer runs LVF on vLLM v0.6.6 (§5), whose running queue
        still preempts a request that cannot get its blocks (§4.2.1's passive preemption): step 4
        goes on from L's tail without its VLT filter until B_swap = -B_HBM blocks are found (blk(r)
        and the victim's claim). A victim the host room cannot hold is preempted by recompute, as
        vLLM does once device and swap space are both full. None while a swap-out copy is in flight
        (it frees blocks as it lands)."""
        bt, swap, out, dropped = view.block_tokens, running_claims(view) - view.free_device_blocks, [], []
        room = math.inf if view.free_host_blocks is None else view.free_host_blocks
        keys = sorted(((-self.vlt(r, view.now_s), r.arrival_s, r.req_id), r) for r in view.running)
        while swap > 0 and keys and not self._pending_out:  # keys.pop(): L's tail
            r = keys.pop()[1]
            need = kv_blocks(r, bt)
            if need <= room:
                out.append(r)
                room -= need
            else:
                dropped.append(r)
            swap -= need + claim(r, bt)
        return out, dropped

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        preempted, prioritised, released = self.rotate(view)
        d = self.plan(view, preempted, prioritised, released, batch=self.running_batch(view, preempted))
        if view.running and not (d.prefill or d.decode or d.swap_in or d.swap_out):
            out, dropped = self.unstall(view)  # the stall path: passive preemption (§4.2.1, §5)
            if out or dropped:
                d = self.plan(view, out, prioritised, self.swap_out(view, out), dropped)
        return d

    @staticmethod
    def plan(
        view: SchedulerView,
        out: Requests,
        prio: Requests,
        freed: int,
        dropped: Requests = (),
        batch: RunningBatch | None = None,
    ) -> SchedulerDecision:
        """``out`` swap out (``freed`` blocks free now), ``dropped`` are preempted by recompute (their
        blocks free now), the rest run (``batch``: their :class:`~kvtier.sched.step_plan.RunningBatch`,
        if known), ``prio`` swap in / start."""
        bt = view.block_tokens
        plan = StepPlan(view, view.free_device_blocks + freed + sum(kv_blocks(r, bt) for r in dropped), out)
        if dropped:
            plan.decision.preempt.extend(r.req_id for r in dropped)
            plan.slots += len(dropped)
            out = (*out, *dropped)
        ids = {r.req_id for r in out}
        plan.run([r for r in view.running if r.req_id not in ids] if ids else view.running, batch)
        for r in prio:
            if r.phase is SWAPPED:
                plan.swap_in(r)
            else:
                plan.admit(r)
        return plan.decision
