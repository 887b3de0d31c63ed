"""Workloads of the simulator: lazy, deterministic streams of :class:`~kvtier.sim.request.Request`.

Every workload is a function taking keyword arguments only (among them the run's ``block_tokens``
and ``seed``) that checks its parameters when called (:class:`~kvtier.errors.ConfigError`, or
:class:`~kvtier.errors.TraceError` for a missing trace) and returns an iterator that builds requests
as they are read, so a long workload holds O(1) requests. The stream's invariants:

- open-loop requests come in non-decreasing ``arrival_s``;
- a closed-loop request (next chat turn, next agent step) names ``parent_id`` and comes right after
  its parent (the session's later turns follow its first turn), with ``arrival_s`` set to its first
  turn's, so ``arrival_s`` never decreases over the whole stream;
- ``block_keys`` has ``ceil(prompt_tokens / block_tokens)`` keys; prefixes shared by construction
  share keys, everything else gets fresh keys from one counter per workload instance (chained: a key
  names the whole prefix up to its block, see :mod:`kvtier.sim.workload.common`);
- the same parameters and ``seed`` give the same stream.

``make_workload(name, **params)`` builds one by name (``workload_names()`` lists them).

Example::

    requests = make_workload("longdoc", block_tokens=16, num_requests=100, rate_per_s=2.0, seed=1)
    first = next(requests)  # first.block_keys: the document's blocks, then the question's
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

from kvtier.errors import ConfigError, did_you_mean
from kvtier.sim.request import Request
from kvtier.sim.workload.agentic import AGENTIC_DATASETS, agentic_workload
from kvtier.sim.workload.arrivals import (
    ARRIVAL_KINDS,
    batch_arrivals,
    gamma_arrivals,
    make_arrivals,
    poisson_arrivals,
)
from kvtier.sim.workload.azure import azure_workload
from kvtier.sim.workload.long_doc_qa import long_doc_qa_workload
from kvtier.sim.workload.longdoc import LONGDOC_DATASETS, longdoc_workload
from kvtier.sim.workload.mooncake import MOONCAKE_BLOCK_TOKENS, mooncake_block_hit_rate, mooncake_workload
from kvtier.sim.workload.multiturn import multiturn_workload

WorkloadFactory = Callable[..., Iterator[Request]]

_WORKLOADS: dict[str, WorkloadFactory] = {
    "agentic": agentic_workload,
    "azure": azure_workload,
    "longdoc": longdoc_workload,
    "long_doc_qa": long_doc_qa_workload,  # LMCache's benchmark: warm-up round, then query round
    "mooncake": mooncake_workload,
    "multiturn": multiturn_workload,
}


def workload_names() -> tuple[str, ...]:
    """Names :func:`make_workload` knows, sorted."""
    return tuple(sorted(_WORKLOADS))


def make_workload(name: str, **params: Any) -> Iterator[Request]:
    """The workload ``name`` built with ``params`` (keyword arguments of its function).

    Raises ConfigError on an unknown name (listing the known ones), an unknown or missing parameter
    (listing the accepted ones) or a bad value.
    """
    factory = _WORKLOADS.get(name)
    if factory is None:
        raise ConfigError(
            f"unknown workload {name!r}{did_you_mean([name], workload_names())}; "
            f"known: {', '.join(workload_names())}"
        )
    signature = inspect.signature(factory)
    accepted = list(signature.parameters)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ConfigError(
            f"workload {name!r} has no parameter(s) {', '.join(unknown)}{did_you_mean(unknown, accepted)}; "
            f"accepted: {', '.join(accepted)}"
        )
    missing = [
        param.name
        for param in signature.parameters.values()
        if param.default is inspect.Parameter.empty and param.name not in params
    ]
    if missing:
        raise ConfigError(f"workload {name!r} needs parameter(s) {', '.join(missing)}")
    return factory(**params)


__all__ = [
    "AGENTIC_DATASETS",
    "ARRIVAL_KINDS",
    "LONGDOC_DATASETS",
    "MOONCAKE_BLOCK_TOKENS",
    "WorkloadFactory",
    "agentic_workload",
    "azure_workload",
    "batch_arrivals",
    "gamma_arrivals",
    "longdoc_workload",
    "make_arrivals",
    "make_workload",
    "mooncake_block_hit_rate",
    "mooncake_workload",
    "multiturn_workload",
    "poisson_arrivals",
    "workload_names",
]
