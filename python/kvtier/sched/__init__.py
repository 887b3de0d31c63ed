"""Scheduling policies behind one interface (:mod:`kvtier.sched.base`), usable by the simulator
and the reference engine. Importing this package registers the built-in policies."""

from kvtier.sched import (  # noqa: F401  (imported to register each policy)
    cachegen_async,
    composed,
    dualpath,
    fcfs,
    hicache,
    lmcache,
    rotasched,
    shadowserve,
    static_swap,
    strata,
    unified_pool,
)
from kvtier.sched.base import (
    LoadMode,
    LoadOrder,
    Phase,
    Policy,
    RequestView,
    SchedulerDecision,
    SchedulerView,
    make_policy,
    policy_names,
    register,
)

__all__ = [
    "LoadMode",
    "LoadOrder",
    "Phase",
    "Policy",
    "RequestView",
    "SchedulerDecision",
    "SchedulerView",
    "fcfs",
    "hicache",
    "lmcache",
    "make_policy",
    "policy_names",
    "register",
]
