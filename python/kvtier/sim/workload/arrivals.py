"""Open-loop arrival processes: endless, non-decreasing streams of arrival times in seconds.

- ``poisson``: exponential inter-arrival gaps with mean ``1 / rate_per_s`` (the usual open-loop load
  of serving papers: Strata §5.1, ShadowServe §6.1, SuperInfer §5.1).
- ``gamma``: Gamma gaps with the same mean and coefficient of variation ``cv`` (shape ``1 / cv**2``):
  ``cv > 1`` is burstier than Poisson, ``cv < 1`` more regular, ``cv == 1`` is Poisson.
- ``batch``: everything at ``start_s`` (an offline batch, like DualPath's agent batches, §7).

The factory functions check their parameters when called (ConfigError) and return a lazy
generator; gaps are drawn in chunks, so a stream costs O(1) memory however long it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from kvtier.sim.workload.common import require_choice, require_non_negative, require_positive

ARRIVAL_KINDS = ("poisson", "gamma", "batch")

_CHUNK = 256


def poisson_arrivals(rate_per_s: float, rng: np.random.Generator, *, start_s: float = 0.0) -> Iterator[float]:
    """Arrival times of a Poisson process of ``rate_per_s`` arrivals per second after ``start_s``."""
    mean_gap_s = 1.0 / require_positive("rate_per_s", rate_per_s)
    start_s = require_non_negative("start_s", start_s)
    return _accumulate(lambda: rng.exponential(mean_gap_s, _CHUNK), start_s)


def gamma_arrivals(
    rate_per_s: float, cv: float, rng: np.random.Generator, *, start_s: float = 0.0
) -> Iterator[float]:
    """Arrival times with Gamma gaps of mean ``1 / rate_per_s`` and coefficient of variation ``cv``."""
    rate_per_s = require_positive("rate_per_s", rate_per_s)
    shape = 1.0 / require_positive("cv", cv) ** 2
    scale_s = 1.0 / (rate_per_s * shape)
    start_s = require_non_negative("start_s", start_s)
    return _accumulate(lambda: rng.gamma(shape, scale_s, _CHUNK), start_s)


def batch_arrivals(*, start_s: float = 0.0) -> Iterator[float]:
    """Every arrival at ``start_s``."""
    start_s = require_non_negative("start_s", start_s)
    return _constant(start_s)


def make_arrivals(
    kind: str, rate_per_s: float, rng: np.random.Generator, *, cv: float = 1.0, start_s: float = 0.0
) -> Iterator[float]:
    """The arrival process ``kind`` (one of :data:`ARRIVAL_KINDS`); ``cv`` is used by ``gamma`` only,
    ``rate_per_s`` is ignored by ``batch``."""
    require_choice("arrival", kind, ARRIVAL_KINDS)
    if kind == "poisson":
        return poisson_arrivals(rate_per_s, rng, start_s=start_s)
    if kind == "gamma":
        return gamma_arrivals(rate_per_s, cv, rng, start_s=start_s)
    return batch_arrivals(start_s=start_s)


def _accumulate(draw_gaps: Callable[[], np.ndarray], start_s: float) -> Iterator[float]:
    now_s = start_s
    while True:
        for gap_s in draw_gaps():
            now_s += float(gap_s)
            yield now_s


def _constant(value: float) -> Iterator[float]:
    while True:
        yield value
