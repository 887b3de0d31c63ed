"""``hicache``: SGLang-HiCache-like baseline. Write-through to host; a request's host/SSD prefix
loads *layerwise*, overlapped with the step's compute (layer l starts once its KV arrived). Its
paper's copies are per page per layer with cudaMemcpyAsync: small segments (page 32 tokens, Strata
§5.1) reach only ~22% of PCIe 5.0 bandwidth (Strata §3.1, Fig. 3). The copies are data-plane config
(the sim config's ``load`` section, ``engine: per_page`` by default for this policy, ``page_tokens``
the page size; :mod:`kvtier.sched.load_path`), not the policy's."""

from __future__ import annotations

from kvtier.sched.base import LoadMode, Policy, SchedulerDecision, SchedulerView, register
from kvtier.sched.batching import admit_fcfs, schedule_running, steady_fcfs


@register
class HiCache(Policy):
    name = "hicache"

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        decision = SchedulerDecision()
        budget = schedule_running(view, decision)
        admit_fcfs(
            view,
            decision,
            budget,
            load_mode=LoadMode.LAYERWISE,
            reserve_full_prompt=True,  # SGLang admits a request only if its whole input fits
        )
        return decision

    def steady_decode(self, view: SchedulerView) -> bool:
        return steady_fcfs(view)  # FCFS batching: decodes first, nobody to admit
