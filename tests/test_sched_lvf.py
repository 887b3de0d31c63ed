"""The rotary set (:class:`kvtier.sched.lvf.RotarySet`) kept across views: after any sequence of
views, its order, blk(r) sum and suffix minima are those rebuilt from its members (issue 20: the
suffix minima are kept in place, not rebuilt per view)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.sched.base import Phase, RequestView
from kvtier.sched.lvf import Entry, RotarySet

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
