"""The frozen views a simulated engine shows its policy (:class:`RequestView`, :class:`SchedulerView`),
filled without their frozen ``__setattr__`` (issue 20: a view per running request and one
``SchedulerView`` per step), and the sub-views a composed policy hands its stages
(:func:`sub_view`, two a step).

Each class here has its frozen class's slots, in its order, and no ``__setattr__`` of its own: one is
filled with plain attribute stores and then becomes the frozen class (``__class__`` assignment,
allowed between classes of one slot layout), so it is of that type, with its fields, equality, hash
and frozenness (``tests/test_sim_engine.py``, ``tests/sim/test_view_fill.py``), at a fraction of the
cost of the frozen ``__init__``'s ``object.__setattr__`` per field. A frozen class whose fields
change fails the import here, not a replay.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

from kvtier.sched.base import Phase, RequestView, SchedulerView
from kvtier.tiers import PerTier

REQUEST_FIELDS = (
    "req_id",
    "arrival_s",
    "phase",
    "prompt_tokens",
    "computed_tokens",
    "generated_tokens",
    "cached_tokens",
    "in_queue_tokens",
    "in_flight_tokens",
    "block_keys",
)
SCHEDULER_FIELDS = (
    "now_s",
    "waiting",
    "running",
    "fetching",
    "swapped",
    "free_device_blocks",
    "free_host_blocks",
    "block_tokens",
    "max_batch_tokens",
    "max_running",
    "num_layers",
    "cost",
    "kv_bytes_per_token",
    "swap_copy",
    "fetch",
    "layerwise_prefill",
)
for _cls, _fields in ((RequestView, REQUEST_FIELDS), (SchedulerView, SCHEDULER_FIELDS)):
    if tuple(f.name for f in dataclasses.fields(_cls)) != _fields:
        raise ImportError(f"{_cls.__name__}'s fields changed: update kvtier.sched.view_fill")
if any(hasattr(RequestView, name) for name in ("__bool__", "__len__")):
    raise ImportError("RequestView defines truth: update kvtier.sim.view.SwappedViews.views")


class UnfrozenRequestView:
    """:class:`RequestView`'s slots, filled by :mod:`kvtier.sim.view`, then a ``RequestView``."""

    __slots__ = REQUEST_FIELDS
    req_id: int
    arrival_s: float
    phase: Phase
    prompt_tokens: int
    computed_tokens: int
    generated_tokens: int
    cached_tokens: PerTier
    in_queue_tokens: int
    in_flight_tokens: int
    block_keys: tuple[int, ...]


class UnfrozenSchedulerView:
    """:class:`SchedulerView`'s slots (the fields' types are SchedulerView's), filled by
    :func:`kvtier.sim.view.build_view` and :func:`sub_view`, then a ``SchedulerView``."""

    __slots__ = SCHEDULER_FIELDS


_SCHEDULER_SET = frozenset(SCHEDULER_FIELDS)
_SCHEDULER_INDEX = {name: i for i, name in enumerate(SCHEDULER_FIELDS)}
_scheduler_fields = operator.attrgetter(*SCHEDULER_FIELDS)  # a view's fields, in one call


def sub_view(view: SchedulerView, **changes: Any) -> SchedulerView:
    """``dataclasses.replace(view, **changes)``, filled as :class:`UnfrozenSchedulerView`; a name that
    is not a field raises as ``replace`` does."""
    if not changes.keys() <= _SCHEDULER_SET:
        raise TypeError(f"SchedulerView has no field {sorted(changes.keys() - _SCHEDULER_SET)}")
    values = list(_scheduler_fields(view))
    for name, value in changes.items():
        values[_SCHEDULER_INDEX[name]] = value
    v = object.__new__(UnfrozenSchedulerView)
    for name, value in zip(SCHEDULER_FIELDS, values, strict=True):
        setattr(v, name, value)
    v.__class__ = SchedulerView  # type: ignore[assignment]  # same slots: a SchedulerView from here
    return v  # type: ignore[return-value]
