"""The simulator's streaming latency histogram: adding a step's token gaps at once is adding each."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier.sim.metrics import LogHistogram, Metrics

# Runs of equal gaps, as a step's decodes that last stepped together give (add_all reuses a run's bucket).
gaps = st.lists(st.tuples(st.floats(0.0, 1e4, allow_nan=False), st.integers(1, 4)), max_size=20).map(
    lambda runs: [v for v, n in runs for _ in range(n)]
)


def state(h: LogHistogram) -> tuple[object, ...]:
    return (h.count, h.total, h.min, h.max, h._buckets, h.quantile(0.5), h.quantile(0.99))


@given(st.lists(gaps, max_size=6))
def test_add_all_is_add_of_each_in_order(steps: list[list[float]]) -> None:
    one, batched = LogHistogram(), LogHistogram()
    for values in steps:
        for v in values:
            one.add(v)
        batched.add_all(values)
    assert repr(state(one)) == repr(state(batched))


@given(st.lists(gaps, max_size=6), st.sampled_from([None, 0.05, 1.0]))
def test_a_steps_gaps_count_as_each_gap(steps: list[list[float]], slo: float | None) -> None:
    one, batched = Metrics(slo_tpot_s=slo), Metrics(slo_tpot_s=slo)
    for values in steps:
        for v in values:
            one.add_tbt(v)
        if values:
            batched.add_tbts(values)
    assert (one.tbt_gaps, one.slo_tbt_gaps_met) == (batched.tbt_gaps, batched.slo_tbt_gaps_met)
    assert repr(state(one.tbt_s)) == repr(state(batched.tbt_s))


@given(
    st.lists(st.floats(0.0, 1e4, allow_nan=False), max_size=20),
    st.integers(1, 5),
    st.sampled_from([None, 0.05]),
)
def test_repeated_gaps_count_as_each_gap_in_a_row(
    values: list[float], repeat: int, slo: float | None
) -> None:
    # A decode run's steps (the fast-forward): one gap a step, the same for each of its decodes.
    one, batched = Metrics(slo_tpot_s=slo), Metrics(slo_tpot_s=slo)
    for v in values:
        for _ in range(repeat):
            one.add_tbt(v)
    batched.add_tbts(values, repeat)
    assert (one.tbt_gaps, one.slo_tbt_gaps_met) == (batched.tbt_gaps, batched.slo_tbt_gaps_met)
    assert repr(state(one.tbt_s)) == repr(state(batched.tbt_s))
