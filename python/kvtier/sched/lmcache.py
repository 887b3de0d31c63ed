"""``lmcache``: vLLM + LMCache-like baseline. Computed prompt KV is written through to host (and
SSD below it); on admission, a request's host/SSD prefix is loaded *synchronously*: the step's
compute waits for the load (blocked I/O). Loads move whole chunk objects (LMCache's 256-token
chunks, Strata §5.1), so segments are large: the object is the sim config's ``block_tokens``, moved
whole by the ``plain`` load path (data-plane config, not the policy's)."""

from __future__ import annotations

from kvtier.sched.base import LoadMode, Policy, SchedulerDecision, SchedulerView, register
from kvtier.sched.batching import admit_fcfs, schedule_running, steady_fcfs


@register
class LmCache(Policy):
    name = "lmcache"

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        decision = SchedulerDecision()
        budget = schedule_running(view, decision)
        admit_fcfs(view, decision, budget, load_mode=LoadMode.SYNC)
        return decision

    def steady_decode(self, view: SchedulerView) -> bool:
        return steady_fcfs(view)  # FCFS batching: decodes first, nobody to admit
