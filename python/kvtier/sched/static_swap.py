"""``waiting_first`` and ``swapped_first``: the two static, SLO-unaware offloading policies of
SuperInfer §3.1 (Fig. 1), baselines for RotaSched (:mod:`kvtier.sched.rotasched`).

Both preempt by swapping KV to host (never by recompute) and differ in who gets freed HBM:

- **Waiting-First (WF)** admits waiting requests FCFS and, when one does not fit, swaps out running
  decodes from the running queue's tail (the most recently admitted, vLLM's lowest priority) to make
  room; swapped requests resume only once no request is waiting. TTFT drops, TBT suffers (§3.1).
- **Swapped-First (SF)** is vLLM's swap policy: swapped requests resume first, FCFS, and waiting ones
  are admitted only when none is left swapped; running requests are swapped out only when a decode
  cannot get a block (passive preemption, tail first). It protects TBT but behaves like FCFS (§3.1).

Both keep the running batch's claims (unfinished prompts, a decode's next block) out of the blocks
they hand out, like RotaSched. How swaps move KV is the engine's (data-plane config: the sim
config's ``swap: {engine: ...}``); §3.1 ran on vLLM's own swap path, ``vllm``, what a config naming
none gets (:mod:`kvtier.sched.data_plane`).
"""

from __future__ import annotations

from kvtier.sched.base import Phase, Policy, RequestView, SchedulerDecision, SchedulerView, register
from kvtier.sched.batching import steady_fcfs
from kvtier.sched.claims import claim, kv_blocks, released_now, running_claims
from kvtier.sched.step_plan import StepPlan


class _StaticSwap(Policy):
    def _released(self, view: SchedulerView, r: RequestView) -> int:
        # Static policies keep no history: under eager rotation, count the blocks full now less the
        # one that may have filled during the last step (its copy may still be in flight).
        bt = view.block_tokens
        synced = max((r.computed_tokens + r.generated_tokens) // bt - 1, 0)
        return released_now(r, view.swap_copy, synced, bt)

    def _passive(self, view: SchedulerView, victims: list[RequestView]) -> tuple[list[RequestView], int]:
        """Swaps out running requests from the tail while the running batch's claims exceed the
        free blocks (vLLM's preemption when a decode cannot append a slot). Returns (swapped out,
        free blocks left after the claims, counting what the swap-outs release now)."""
        bt = view.block_tokens
        free = view.free_device_blocks - running_claims(view)
        out: list[RequestView] = []
        while free < 0 and victims:
            victim = victims.pop()
            out.append(victim)
            free += self._released(view, victim) + claim(victim, bt)
        return out, free

    def _steady(self, view: SchedulerView) -> bool:
        """:meth:`Policy.steady_decode` of both. With nobody waiting, fetching or swapped, both
        decide :meth:`_passive` then :meth:`StepPlan.run` and nothing else (no one to admit or
        resume): every running request decodes, in order, iff the batch fits ``max_batch_tokens``,
        each is past its prefill and the batch's claims (:func:`running_claims`) fit the free
        blocks; otherwise tail decodes are swapped out or stall.

        A claim is reckoned from token counts, not from the blocks the engine holds, so it can
        differ from the engine's block check (``Engine.plan_decode``): a request swapped out right
        after its prefill comes back holding the block of its first token, which its claim
        (``generated == 1``: that token's KV not written yet) still counts; an engine holding a
        block beyond its context would be claimed for one too, while its decode run goes on. So
        the later views are bounded, not assumed to claim nothing: the engine holds at least the
        blocks a claim counts as written, so this step takes at most :func:`running_claims` new
        blocks; while the run holds nothing else takes any (no admission, load, swap-in or
        finish); and in each later step every request has generated >= 2, so it claims at most
        one block. The decision stays the plain decode while the free blocks left after this
        step's claims cover one block per running request.
        """
        if not steady_fcfs(view):
            return False
        running = view.running
        if any(r.generated_tokens < 1 for r in running):  # not reached: a prefill emits a token
            return False
        return running_claims(view) + len(running) <= view.free_device_blocks

    def _plan(self, view: SchedulerView, out: list[RequestView], released: int) -> StepPlan:
        gone = {r.req_id for r in out}
        plan = StepPlan(view, view.free_device_blocks + released, out)
        plan.run([r for r in view.running if r.req_id not in gone] if gone else view.running)
        return plan


@register
class WaitingFirst(_StaticSwap):
    name = "waiting_first"

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        bt = view.block_tokens
        decoding = [r for r in view.running if r.computed_tokens >= r.prompt_tokens]
        out, free = self._passive(view, decoding)
        # Plan admissions first: each waiting request that does not fit swaps out tail decodes.
        budget = view.max_batch_tokens
        for r in view.running:  # less each one's step_tokens, inline (per running request per step)
            rest = r.prompt_tokens - r.computed_tokens
            budget -= (rest if rest < view.max_batch_tokens else view.max_batch_tokens) if rest > 0 else 1
        admitted = 0
        for w in view.waiting:
            need = kv_blocks(w, bt)
            while need > free and decoding:
                victim = decoding.pop()
                released = self._released(view, victim)
                if released <= 0:  # a non-eager copy in the pipeline frees nothing now
                    decoding.clear()
                    break
                out.append(victim)
                free += released + claim(victim, bt)
                budget += 1
            if need > free or budget <= 0:
                break
            free -= need
            budget -= w.prompt_tokens
            admitted += 1
        released = sum(self._released(view, r) for r in out)
        plan = self._plan(view, out, released)
        for w in view.waiting:
            if not plan.admit(w):
                break
        if admitted >= len(view.waiting):  # nobody waits any longer: swapped requests resume
            for r in sorted(view.swapped, key=lambda s: (s.arrival_s, s.req_id)):
                if not plan.swap_in(r):
                    break
        return plan.decision

    def steady_decode(self, view: SchedulerView) -> bool:
        return self._steady(view)


@register
class SwappedFirst(_StaticSwap):
    name = "swapped_first"

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        out, _ = self._passive(view, list(view.running))
        released = sum(self._released(view, r) for r in out)
        plan = self._plan(view, out, released)
        swapped = sorted(view.swapped, key=lambda s: (s.arrival_s, s.req_id))
        resumed = 0
        if not out:  # vLLM: no swap-in in an iteration that had to preempt
            for r in swapped:
                if not plan.swap_in(r):
                    break
                resumed += 1
        if resumed == len(swapped):  # waiting requests only once nothing is left swapped
            for w in view.waiting:
                if w.phase is Phase.WAITING and not plan.admit(w):
                    break
        return plan.decision

    def steady_decode(self, view: SchedulerView) -> bool:
        return self._steady(view)
