"""The rotary set (:class:`kvtier.sched.lvf.RotarySet`) kept across views: after any sequence of
views, its order, blk(r) sum and suffix minima are those rebuilt from its members (issue 20: the
suffix minima are kept in place, not rebuilt per view)."""

from __future__ import annotations

from random import Random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.sched.base import Phase, RequestView
from kvtier.sched.lvf import Entry, Head, RotarySet, take_heads, take_tails

# One view's rotary requests: request id -> (t_last, blk(r)); few t_lasts and blocks, so both tie.
_shown = st.dictionaries(st.integers(0, 40), st.tuples(st.integers(0, 5), st.integers(1, 6)), max_size=30)


@settings(max_examples=300, deadline=None)
@given(st.lists(_shown, min_size=1, max_size=12))
def test_the_kept_set_is_the_set_rebuilt_from_its_members(
    shown_seq: list[dict[int, tuple[int, int]]],
) -> None:
    rotary = RotarySet()
    views: dict[tuple[int, int, int], RequestView] = {}  # a request's view kept while it is unchanged
    for shown_now in shown_seq:
        shown = []
        for rid, (t_last, need) in shown_now.items():
            key = (rid, t_last, need)
            if key not in views:
                views[key] = RequestView(rid, float(rid % 3), Phase.SWAPPED, need, need, 0)
            shown.append(views[key])
        fresh, gone = rotary.diff(shown)
        entries: list[Entry] = [
            (float(shown_now[r.req_id][0]), r.arrival_s, r.req_id, shown_now[r.req_id][1], r, 0)
            for r in fresh
        ]
        rotary.update(shown, gone, entries)
        order = sorted(rotary.entries.values())
        assert rotary.order == order
        assert {e[2]: (int(e[0]), e[3]) for e in order} == shown_now
        assert rotary.total == sum(e[3] for e in order)
        assert rotary.mins == [min(e[3] for e in order[i:]) for i in range(len(order))]


@settings(max_examples=500, deadline=None)
@given(
    st.integers(0, 12),
    st.integers(0, 2),
    st.lists(st.integers(0, 17), max_size=16),
    st.sampled_from(["kept", "sorted", "shuffled"]),
    st.randoms(use_true_random=False),
)
def test_the_walk_finds_what_the_sets_find(
    members: int, twice: int, picks: list[int], order: str, rnd: Random
) -> None:
    """``diff``'s side-by-side walk against comparing sets: the same new views (in the same order)
    and the same members gone, whether ``shown`` keeps the last order (a simulator's), reorders it
    or shows a view twice (the walk gives up on those: either way the answer is the sets')."""
    pool = [RequestView(rid % 9, 0.0, Phase.SWAPPED, 1, 1, 0) for rid in range(18)]  # request ids tie
    rotary = RotarySet()
    last = pool[:members]
    entries: list[Entry] = [(float(k), 0.0, k, 1, r, 0) for k, r in enumerate(last)]
    rotary.update(last + last[:twice], [], entries)  # members shown twice last time, too
    if order == "kept":  # what is kept stays in its order; new ones anywhere
        kept = sorted({p for p in picks if p < members})
        new = [p for p in picks if p >= members]
        shown_at = [pool[p] for p in kept]
        for p in new:
            shown_at.insert(rnd.randrange(len(shown_at) + 1), pool[p])
    else:
        shown_at = [pool[p] for p in (sorted(picks) if order == "sorted" else picks)]
    fresh, gone = rotary.diff(shown_at)
    sets_fresh, sets_gone = rotary._diff_by_sets(shown_at)
    assert [id(r) for r in fresh] == [id(r) for r in sets_fresh]
    assert sorted(gone) == sorted(sets_gone)


# Step 3's walk of the kept set and step 4's victims (issue 20, twentieth slice): what Algorithm 1
# takes, one sort of every candidate, at any B_left.
_rotary = st.dictionaries(
    st.integers(0, 40),
    st.tuples(st.sampled_from([0.0, 2**-60, 0.5, 1.0, 2.0]), st.integers(0, 3), st.integers(1, 6)),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(_rotary, st.integers(0, 60), st.sampled_from([0.0, 1.0, 3.0]), st.sampled_from([0.0, 1.5]))
def test_the_kept_sets_walk_takes_what_one_sort_takes(
    drawn: dict[int, tuple[float, int, int]], left: int, alpha: float, lag_s: float
) -> None:
    """t_last near-equal (VLTs that round together), equal arrivals and ReLU's zeros: runs of equal
    VLT over several t_last, read in (arrival, id) order; requests that do not fit passed over."""
    now, rotary = 2.0, RotarySet()
    views = {
        rid: RequestView(rid, float(arrival), Phase.SWAPPED, 9, 9, 1)
        for rid, (_, arrival, _) in drawn.items()
    }
    entries: list[Entry] = [
        (t, views[rid].arrival_s, rid, need, views[rid], 0) for rid, (t, _, need) in drawn.items()
    ]
    rotary.update(tuple(views.values()), [], entries)
    heads: list[Head] = []
    for t_last, arrival, rid, need, r, _ in entries:
        vlt = alpha * max(0.0, now - t_last - lag_s)
        heads.append(((-vlt, arrival, rid), need, r))
    heads.sort()
    assert take_heads([], left, rotary, now, alpha, lag_s) == take_heads(heads, left)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([0.5, 1.0, 2.0]), st.integers(0, 3), st.integers(1, 6)), max_size=20),
    st.integers(-2, 60),
    st.sampled_from([None, 0, 5, 20]),
)
def test_step_4_takes_its_victims_from_the_tail_of_one_sort(
    drawn: list[tuple[float, int, int]], swap: int, host: int | None
) -> None:
    tails: list[Head] = [
        ((lag, float(arrival), rid), need, RequestView(rid, float(arrival), Phase.RUNNING, 9, 9, 1))
        for rid, (lag, arrival, need) in enumerate(drawn)
    ]
    expected, room, left = [], float("inf") if host is None else host, swap
    for _, need, r in sorted(tails, reverse=True):
        if left <= 0:
            break
        if need <= room:
            expected.append(r)
            room, left = room - need, left - need
    assert take_tails(list(tails), swap, host) == expected
