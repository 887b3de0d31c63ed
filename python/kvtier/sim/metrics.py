"""Streaming metrics: bounded memory however long the trace.

Latencies go into :class:`LogHistogram` (log-spaced buckets, 1% relative resolution), so p50/p99
need no per-request list. Finished requests are folded in and forgotten.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NotRequired, TypedDict

from kvtier.tiers import PerTier, Tier


class Summary(TypedDict):
    """One latency's :meth:`LogHistogram.summary`, in seconds (NaN where nothing was counted)."""

    mean: float
    p50: float
    p90: float
    p99: float
    max: float


class SloFigures(TypedDict):
    """The SLOs a run was judged against (None: not set, always met) and the shares that met them."""

    ttft_s: float | None
    tpot_s: float | None
    ttft_attainment: float
    tpot_attainment: float
    attainment: float
    #: Share of token gaps (not requests) within the TBT SLO: an alternative reading.
    tbt_gap_attainment: float


class SimMetrics(TypedDict):
    """:meth:`Metrics.result`: what a simulated run measured (JSON-ready)."""

    requests: int
    makespan_s: float
    ttft_s: Summary
    tpot_s: Summary
    tbt_s: Summary
    jct_s: Summary
    throughput_requests_per_s: float
    throughput_output_tokens_per_s: float
    throughput_total_tokens_per_s: float
    slo: SloFigures
    #: Share of prompt tokens found in each tier (by label), and in all of them (``total``).
    hit_rate_tokens: dict[str, float]
    #: Prefix blocks found in any tier when each request was first admitted, over all blocks.
    hit_rate_blocks: float
    prompt_tokens: int
    output_tokens: int
    blocked_io_s: float
    fetch_stall_s: float
    blocked_io_fraction_of_busy: float
    steps: int
    preemptions: int
    #: Per link (by name): its utilisation and bytes moved in each direction.
    links: dict[str, dict[str, float]]
    # With ``ttft_window_s``: time to second token, steady-state TTFT, and TTFT per window
    # (``[window start s, mean TTFT s, requests]``).
    ttst_s: NotRequired[Summary]
    ttft_steady_s: NotRequired[Summary]
    ttft_windows: NotRequired[list[list[float]]]
    # DualPath's node groups (:mod:`kvtier.sim.dualpath`): storage-NIC read balance, bytes
    # persisted, and the prefill engines' busy share.
    storage_nic_read_max_over_mean: NotRequired[float]
    bytes_written: NotRequired[float]
    pe_busy_fraction: NotRequired[float]


class LogHistogram:
    """Counts of positive values in buckets of ratio ``1 + resolution``; exact count/sum/min/max."""

    def __init__(self, resolution: float = 0.01, floor: float = 1e-7) -> None:
        self._log_base = math.log1p(resolution)
        self._floor = floor
        self._buckets: dict[int, int] = {}
        self._last_bucket = (0, math.nan, math.nan)  # add_all's: an index, and values surely in it
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf

    def add(self, value: float) -> None:
        # min()/max() spelled as comparisons (same results; this runs once per generated token).
        self.count += 1
        self.total += value
        if value < self.min:
            self.min = value
        if value > self.max:
            self.max = value
        floor = self._floor
        index = int(math.log((floor if floor > value else value) / floor) / self._log_base)
        buckets = self._buckets
        buckets[index] = buckets.get(index, 0) + 1

    def add_all(self, values: Sequence[float], repeat: int = 1) -> None:
        """``add`` of each value, in order, ``repeat`` times in a row, in one loop (the same counts,
        sum, min, max, buckets)."""
        if not values:
            return
        total = self.total
        if repeat == 1:  # the sum one addition a value, in order: the same float as `add` gives
            for value in values:
                total += value
        else:  # ... and `repeat` additions of each in a row
            more = range(repeat)
            for value in values:
                for _ in more:
                    total += value
        self.total, self.count = total, self.count + len(values) * repeat
        # The first of the smallest (largest) values, as `add`'s comparisons keep it.
        if (lo := min(values)) < self.min:
            self.min = lo
        if (hi := max(values)) > self.max:
            self.max = hi
        floor, log_base, buckets = self._floor, self._log_base, self._buckets
        log, exp, get = math.log, math.exp, buckets.get
        index, inside_low, inside_high = self._last_bucket
        run = 0  # values in a row in bucket `index` not counted yet
        for value in values:
            # Gaps come in runs of nearly equal values: one well inside the last value's bucket
            # (a relative 1e-9 from its edges, far above the log's rounding) has its index.
            if not inside_low < value < inside_high:
                if run:
                    buckets[index] = get(index, 0) + run * repeat
                    run = 0
                index = int(log((floor if floor > value else value) / floor) / log_base)
                inside_low = floor * exp(index * log_base) * (1.0 + 1e-9)
                inside_high = floor * exp((index + 1) * log_base) * (1.0 - 1e-9)
            run += 1
        buckets[index] = get(index, 0) + run * repeat
        self._last_bucket = (index, inside_low, inside_high)

    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        """Value at quantile ``q`` (bucket midpoint, clamped to the exact min/max)."""
        if not self.count:
            return math.nan
        rank = q * (self.count - 1)
        seen = 0
        for index in sorted(self._buckets):
            seen += self._buckets[index]
            if seen > rank:
                mid = self._floor * math.exp((index + 0.5) * self._log_base)
                return min(max(mid, self.min), self.max)
        return self.max

    def summary(self) -> Summary:
        return {
            "mean": self.mean(),
            "p50": self.quantile(0.5),
            "p90": self.quantile(0.9),
            "p99": self.quantile(0.99),
            "max": self.max if self.count else math.nan,
        }


@dataclass
class RequestRecord:
    """What one finished request contributes."""

    arrival_s: float
    first_token_s: float
    finish_s: float
    prompt_tokens: int
    output_tokens: int
    hit_tokens: PerTier
    max_tbt_s: float
    matched_blocks: int = 0
    prompt_blocks: int = 0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (0 for single-token outputs)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)


@dataclass
class Metrics:
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    ttft_s: LogHistogram = field(default_factory=LogHistogram)
    tpot_s: LogHistogram = field(default_factory=LogHistogram)
    tbt_s: LogHistogram = field(default_factory=LogHistogram)
    jct_s: LogHistogram = field(default_factory=LogHistogram)
    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    hit_tokens: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    slo_ttft_met: int = 0
    slo_tpot_met: int = 0
    slo_both_met: int = 0
    tbt_gaps: int = 0  # token gaps seen (``add_tbt``)
    slo_tbt_gaps_met: int = 0  # ... of them within slo_tpot_s (a per-token reading of a TBT SLO)
    first_arrival_s: float = math.inf
    last_finish_s: float = 0.0
    blocked_io_s: float = 0.0
    fetch_stall_s: float = 0.0  # GPU idle, nothing to compute, while async fetches are in flight
    busy_s: float = 0.0
    steps: int = 0
    preemptions: int = 0
    matched_blocks: int = 0
    prompt_blocks: int = 0
    # First tokens as they happen (:meth:`first_token`; a cluster that calls it sets
    # ``ttft_window_s``): TTFT of requests arriving from ``measure_from_s`` on (past an online run's
    # warm-up), and TTFT by window of first-token time (sum, count), whose trend tells a steady
    # state from a slowly filling queue (DualPath §7.4's steady-state test). TTST: first token to
    # the decode engine's first step, in a P/D cluster.
    ttft_window_s: float | None = None
    measure_from_s: float = 0.0
    ttft_steady_s: LogHistogram = field(default_factory=LogHistogram)
    ttft_windows: dict[int, list[float]] = field(default_factory=dict)
    ttst_s: LogHistogram = field(default_factory=LogHistogram)
    # Every finished request's record, in finish order, where a list is set (tests/sim_records.py:
    # checking that a speedup, or the compiled build, changes no decision); None keeps none.
    records: list[RequestRecord] | None = None

    def first_token(self, arrival_s: float, now_s: float) -> None:
        """A request's first token, now (also counted at its finish by :meth:`add_request`)."""
        if arrival_s >= self.measure_from_s:
            self.ttft_steady_s.add(now_s - arrival_s)
        if self.ttft_window_s is not None:
            window = self.ttft_windows.setdefault(int(now_s // self.ttft_window_s), [0.0, 0.0])
            window[0] += now_s - arrival_s
            window[1] += 1

    def add_request(self, r: RequestRecord) -> None:
        self.requests += 1
        self.prompt_tokens += r.prompt_tokens
        self.matched_blocks += r.matched_blocks
        self.prompt_blocks += r.prompt_blocks
        self.output_tokens += r.output_tokens
        for i, t in enumerate(r.hit_tokens):
            self.hit_tokens[i] += t
        self.ttft_s.add(r.ttft_s)
        if r.output_tokens > 1:
            self.tpot_s.add(r.tpot_s)
        self.jct_s.add(r.finish_s - r.arrival_s)
        ttft_ok = self.slo_ttft_s is None or r.ttft_s <= self.slo_ttft_s
        tpot_ok = self.slo_tpot_s is None or r.tpot_s <= self.slo_tpot_s
        self.slo_ttft_met += ttft_ok
        self.slo_tpot_met += tpot_ok
        self.slo_both_met += ttft_ok and tpot_ok
        self.first_arrival_s = min(self.first_arrival_s, r.arrival_s)
        self.last_finish_s = max(self.last_finish_s, r.finish_s)
        if self.records is not None:
            self.records.append(r)

    def add_tbt(self, gap_s: float) -> None:
        self.tbt_s.add(gap_s)
        self.tbt_gaps += 1
        self.slo_tbt_gaps_met += self.slo_tpot_s is None or gap_s <= self.slo_tpot_s

    def add_tbts(self, gaps_s: Sequence[float], repeat: int = 1) -> None:
        """The token gaps of one or more steps, in order, each ``repeat`` times in a row (a decode
        run's steps: one gap a step, the same for each of its decodes); a loop here, not a call each."""
        self.tbt_s.add_all(gaps_s, repeat)
        self.tbt_gaps += len(gaps_s) * repeat
        slo = self.slo_tpot_s
        met = len(gaps_s) if slo is None else sum(1 for g in gaps_s if g <= slo)
        self.slo_tbt_gaps_met += met * repeat

    def result(self, links: dict[str, dict[str, float]] | None = None) -> SimMetrics:
        out = self._result(links)
        if self.ttft_window_s is not None:
            out["ttst_s"] = self.ttst_s.summary()
            out["ttft_steady_s"] = self.ttft_steady_s.summary()
            out["ttft_windows"] = [
                [k * self.ttft_window_s, total / count, count]
                for k, (total, count) in sorted(self.ttft_windows.items())
            ]
        return out

    def _result(self, links: dict[str, dict[str, float]] | None) -> SimMetrics:
        makespan = max(self.last_finish_s - min(self.first_arrival_s, self.last_finish_s), 1e-12)
        n = max(self.requests, 1)
        hits = {tier.label: self.hit_tokens[tier] / max(self.prompt_tokens, 1) for tier in Tier}
        hits["total"] = sum(self.hit_tokens) / max(self.prompt_tokens, 1)
        return {
            "requests": self.requests,
            "makespan_s": makespan,
            "ttft_s": self.ttft_s.summary(),
            "tpot_s": self.tpot_s.summary(),
            "tbt_s": self.tbt_s.summary(),
            "jct_s": self.jct_s.summary(),
            "throughput_requests_per_s": self.requests / makespan,
            "throughput_output_tokens_per_s": self.output_tokens / makespan,
            "throughput_total_tokens_per_s": (self.prompt_tokens + self.output_tokens) / makespan,
            "slo": {
                "ttft_s": self.slo_ttft_s,
                "tpot_s": self.slo_tpot_s,
                "ttft_attainment": self.slo_ttft_met / n,
                "tpot_attainment": self.slo_tpot_met / n,
                "attainment": self.slo_both_met / n,
                "tbt_gap_attainment": self.slo_tbt_gaps_met / max(self.tbt_gaps, 1),
            },
            "hit_rate_tokens": hits,
            "hit_rate_blocks": self.matched_blocks / max(self.prompt_blocks, 1),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "blocked_io_s": self.blocked_io_s,
            "fetch_stall_s": self.fetch_stall_s,
            "blocked_io_fraction_of_busy": self.blocked_io_s / max(self.busy_s, 1e-12),
            "steps": self.steps,
            "preemptions": self.preemptions,
            "links": links or {},
        }
