"""``fcfs``: the vLLM-like baseline. GPU prefix cache only (no lower tiers), FCFS admission,
chunked prefill, passive preemption by recompute when device blocks run out (done by the engine)."""

from __future__ import annotations

from kvtier.sched.base import Policy, SchedulerDecision, SchedulerView, register
from kvtier.sched.batching import admit_fcfs, schedule_running, steady_fcfs


@register
class Fcfs(Policy):
    name = "fcfs"

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        decision = SchedulerDecision()
        budget = schedule_running(view, decision)
        admit_fcfs(view, decision, budget, load_mode=None)
        return decision

    def steady_decode(self, view: SchedulerView) -> bool:
        return steady_fcfs(view)  # FCFS batching: decodes first, nobody to admit
