"""SuperInfer's Largest-VLT-First (Algorithm 1, §4.2.3) and the rotary set it reads, kept across
iterations so that one iteration costs what it rotates, not what waits (issue 20).

:func:`lvf` is Algorithm 1 over a list of (VLT, request). RotaSched (:mod:`kvtier.sched.rotasched`)
runs the same steps without that list: its waiting head is short (the view shows at most
``view_waiting_max`` waiting requests), its running batch bounded, but its rotary set (requests
swapped to host, kvtier's ``Phase.SWAPPED``) grows with the overload, to hundreds. A rotary
request's VLT is alpha * ReLU(now - t_last - beta_B * S_B) and neither its t_last nor blk(r) changes
while it sits in host memory, so :class:`RotarySet` keeps the rotary requests sorted by
(t_last, arrival, id) between views and updates it by what a swap changed. Along that order the VLT
never rises (IEEE subtraction, ``max`` and a product by alpha >= 0 are monotone), so step 2's order
of the rotary requests is that order with each run of equal VLTs re-sorted by (arrival, id)
(:func:`rotary_heads`), and step 3 can stop as soon as B_left is below every remaining blk(r)
(suffix minima, :attr:`RotarySet.mins`): exactly the requests Algorithm 1 takes, in its order.
The waiting head is kept in one too (the same views step after step, ~60 on an overloaded engine):
sorted by (arrival, id), where its VLT ReLU(now - arrival - beta_F * S_F) never rises, so that order
is step 2's as it is, and :func:`take_heads` reads it in place.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Generator, Iterable, Sequence
from itertools import accumulate, compress, count
from operator import attrgetter, is_not, itemgetter

from kvtier.sched.base import Phase, RequestView
from kvtier.sched.members import RUNNING, SWAPPED
from kvtier.sched.shown import ShownViews

LvfKey = tuple[float, float, int]  # (-VLT, arrival, id): step 2's order, a total one (ids are unique)
Head = tuple[LvfKey, int, RequestView]  # a waiting/rotary request with VLT >= 0: key, blk(r), request
# A rotary request: t_last, arrival, id, blk(r), view, and (for its owner) the view it entered at.
Entry = tuple[float, float, int, int, RequestView, int]

_req_id = attrgetter("req_id")
_head_need = itemgetter(1)
_head_key = itemgetter(0)


def lvf(
    candidates: Sequence[tuple[float, RequestView]],
    blocks: dict[int, int],
    free_blocks: int,
    xfer_blocks: int,
    host_blocks: int | None = None,
) -> tuple[list[RequestView], list[RequestView]]:
    """Algorithm 1 (LVF scheduling): returns (preempted P, prioritised R).

    ``candidates`` are (VLT, request) for every running, waiting and rotary request; ``blocks`` maps
    a request to blk(r); ``free_blocks`` is B_HBM and ``xfer_blocks`` B_xfer; ``host_blocks`` the
    host room swap-outs can take this iteration (None: unbounded), which bounds step 4.
    """
    waiting_rotary = [r for _, r in candidates if r.phase is not RUNNING]
    if free_blocks >= sum(blocks[r.req_id] for r in waiting_rotary):  # step 1: contention check
        return [], sorted(waiting_rotary, key=fcfs_key)  # fall back to FCFS
    heads: list[Head] = []
    tails: list[Head] = []
    for vlt, r in candidates:
        key = (-vlt, r.arrival_s, r.req_id)
        if r.phase is not RUNNING:
            if vlt >= 0:
                heads.append((key, blocks[r.req_id], r))
        elif vlt < 0:
            tails.append((key, blocks[r.req_id], r))
    heads.sort()  # the keys are unique: the need and the request are never compared
    left = free_blocks + xfer_blocks
    prioritised, left = take_heads(heads, left)
    return take_tails(tails, xfer_blocks - left, host_blocks), prioritised


def take_heads(
    heads: Sequence[Head],
    left: int,
    rotary: RotarySet | None = None,
    now_s: float = 0.0,
    alpha: float = 0.0,
    lag_s: float = 0.0,
    waiting: RotarySet | None = None,
    wait_s: float = 0.0,
) -> tuple[list[RequestView], int]:
    """Step 3: from the head of step 2's order, every request whose blk(r) fits what is left of
    B_left. ``heads`` are the waiting requests in step 2's order, or ``waiting`` holds them (kept
    by arrival, VLT = ReLU(now_s - arrival - wait_s): that order is step 2's); the rotary set's
    requests (VLT = alpha * ReLU(now_s - t_last - lag_s)) are merged in. Returns (prioritised R,
    B_left left).

    B_left only falls, so a request whose blk(r) is above it now never fits later: each of the two
    orders is read only up to its next request that fits now (a request passed over costs no key),
    and not at all once none after it can fit (suffix minima of blk(r)); of the two such requests
    the one first in step 2's order is taken (if it still fits: taking the other may have left too
    little)."""
    prioritised: list[RequestView] = []
    if waiting is None and (rotary is None or not rotary.order):  # the heads alone: a plain walk
        for _, need, r in heads:
            if need <= left:
                prioritised.append(r)
                left -= need
        return prioritised, left
    if waiting is not None:
        nw, w_mins, order = len(waiting.order), waiting.mins, waiting.order
    else:
        nw, w_mins, order = len(heads), list(accumulate(map(_head_need, reversed(heads)), min))[::-1], []
    rotary_order, r_mins = (rotary.order, rotary.mins) if rotary is not None else ([], [])
    rot = rotary_heads(rotary_order, r_mins, now_s, alpha, lag_s)
    next(rot)
    nxt = rot.send(left)
    wi, key, w_need = 0, None, 0  # key: the next waiting request that fits, read once (None: not yet)
    while True:
        if key is not None and w_need > left:  # it fitted until a rotary request before it was taken
            key, wi = None, wi + 1
        while key is None and wi < nw:
            if w_mins[wi] > left:  # none of the waiting requests left fits
                wi = nw
            elif waiting is None:
                if heads[wi][1] <= left:
                    key, w_need, w_r = heads[wi]
                else:
                    wi += 1
            elif order[wi][3] <= left:  # its VLT as RotaSched's pass reads it: the same float
                arrival_s, _, rid, w_need, w_r, _ = order[wi]
                vlt = now_s - arrival_s - wait_s
                key = (-(vlt if vlt > 0.0 else 0.0), arrival_s, rid)
            else:
                wi += 1
        while nxt is not None and nxt[1] > left:  # it fitted until a waiting request before it was taken
            nxt = rot.send(left)
        if nxt is None or (key is not None and key < nxt[0]):
            if key is None:
                break
            prioritised.append(w_r)
            left -= w_need
            key, wi = None, wi + 1
        else:
            _, need, r = nxt
            prioritised.append(r)
            left -= need
            nxt = rot.send(left)
    return prioritised, left


def take_tails(tails: list[Head], swap: int, host_blocks: int | None) -> list[RequestView]:
    """Step 4: B_swap = ``swap`` blocks from the tail of step 2's order (running requests with
    VLT < 0, lowest VLT first). A victim the host room left (``host_blocks``) cannot hold is passed
    over: vLLM swaps out only what ``can_swap_out`` allows, and a rotation is a swap, never a
    recompute (§4.2.1)."""
    preempted: list[RequestView] = []
    if swap <= 0:
        return preempted
    tails.sort(key=_head_key, reverse=True)  # by the keys alone (unique, as in lvf): fewer compares
    room = math.inf if host_blocks is None else host_blocks
    for _, need, r in tails:
        if need > room:
            continue
        room -= need
        preempted.append(r)
        swap -= need
        if swap <= 0:
            break
    return preempted


def fcfs_key(r: RequestView) -> tuple[int, float, int]:
    """FCFS with vLLM's order: swapped (rotary) requests resume before waiting ones are admitted."""
    return (0 if r.phase is SWAPPED else 1, r.arrival_s, r.req_id)


class RotarySet:
    """The rotary requests of the last view, sorted by (t_last, arrival, id), with blk(r) each,
    their sum (step 1) and the suffix minima of blk(r) along the order (step 3's stop).

    RotaSched keeps its waiting head in one too (``phase`` WAITING), an entry's t_last being its
    arrival: a waiting request's VLT, ReLU(now - arrival - beta_F * S_F), never rises along that
    order either, and its view is the same object while nothing it read changed (issue 20)."""

    __slots__ = ("by_object", "entries", "ids", "mins", "odd", "order", "phase", "shown", "total")

    def __init__(self, phase: Phase = Phase.SWAPPED) -> None:
        self.phase = phase  # where a simulator shows the members
        self.shown: Sequence[RequestView] = ()  # the view's swapped sequence these were read from
        self.by_object: dict[
            int, int
        ] = {}  # id() of each member's view (kept alive by ``entries``) -> request id
        self.ids: set[int] = set()  # the keys of ``by_object``
        self.entries: dict[int, Entry] = {}  # request id -> its entry in ``order``
        self.order: list[Entry] = []
        self.mins: list[int] = []
        self.total = 0  # sum of blk(r)
        self.odd = 0  # members whose view is not in ``phase`` (not where a simulator shows them)

    def __contains__(self, req_id: int) -> bool:
        return req_id in self.entries

    def diff(self, shown: Sequence[RequestView]) -> tuple[list[RequestView], list[int]]:
        """The views in ``shown`` that are not members (new requests, or members with a new view),
        by request id, and the ids of members whose view is not in ``shown`` (they left, or have a
        new view). Membership is by view object (a view never changes; a request's new state is a
        new view).

        A simulator keeps its swapped requests in one order (that of their swap-outs): ``shown`` is
        the last one less the requests that left, plus new ones in between. The two are walked
        side by side, each run of the same objects compared in C (``is_not``), so that a view costs
        what changed, not one Python-level step per member; where ``shown`` is not such a merge
        (a member moved, or shown twice) the walk finds out and sets are compared instead. A
        :class:`~kvtier.sched.shown.ShownViews` built right after the last one shown says what
        changed itself: no walk."""
        old, members = self.shown, self.ids
        if type(shown) is ShownViews and shown.base is old and len(old) == len(members):
            added, removed = shown.added, shown.removed
            if len(old) - len(removed) + len(added) == len(shown):  # else not the set difference
                return sorted(added, key=_req_id), [self.by_object[id(r)] for r in removed]
        gone: list[RequestView] = []
        fresh: list[RequestView] = []
        i = j = 0
        if len(old) == len(members):  # else a member was shown twice: only the sets can tell
            while (k := next(compress(count(), map(is_not, old[i:], shown[j:])), None)) is not None:
                i, j = i + k, j + k
                r = shown[j]
                if id(r) not in members:
                    fresh.append(r)
                    j += 1
                else:  # r is further on in ``old``: old[i] left (else r ends up in the tail below)
                    gone.append(old[i])
                    i += 1
            same = min(len(old) - i, len(shown) - j)  # the runs matched until one ended
            gone.extend(old[i + same :])
            fresh.extend(shown[j + same :])
            if not any(id(r) in members for r in shown[j + same :]) and _unique(fresh):
                fresh.reverse()  # ties of request id in the order the sets' path leaves them
                fresh.sort(key=_req_id)
                return fresh, [self.by_object[id(r)] for r in gone]
        return self._diff_by_sets(shown)

    def _diff_by_sets(self, shown: Sequence[RequestView]) -> tuple[list[RequestView], list[int]]:
        shown_ids = set(map(id, shown))
        gone = [self.by_object[i] for i in self.ids - shown_ids]
        new = shown_ids - self.ids
        fresh: list[RequestView] = []
        for r in reversed(shown):
            if len(fresh) == len(new):
                break
            if id(r) in new:
                fresh.append(r)
        fresh.sort(key=_req_id)
        return fresh, gone

    def update(self, shown: Sequence[RequestView], gone: Sequence[int], fresh: Iterable[Entry]) -> None:
        """Removes the members ``gone``, adds the entries ``fresh`` (their views are in ``shown``)."""
        order, entries, by_object, mins = self.order, self.entries, self.by_object, self.mins
        for rid in gone:
            entry = entries.pop(rid)
            at = bisect_left(order, entry)  # compared as tuples: (t_last, arrival, id) is unique
            del order[at], mins[at]
            _raise_mins(order, mins, at)
            del by_object[id(entry[4])]
            self.ids.discard(id(entry[4]))
            self.total -= entry[3]
            self.odd -= entry[4].phase is not self.phase
        for entry in fresh:
            rid, r = entry[2], entry[4]
            at = bisect_left(order, entry)
            order.insert(at, entry)
            _lower_mins(mins, at, entry[3])
            entries[rid] = entry
            by_object[id(r)] = rid
            self.ids.add(id(r))
            self.total += entry[3]
            self.odd += r.phase is not self.phase
        self.shown = shown


# The suffix minima are kept in place as members come and go (rebuilding them was a pass over
# every member per view, issue 20). They never fall along ``order``: each is min(blk(r), the next).


def _lower_mins(mins: list[int], at: int, need: int) -> None:
    """``mins`` after an entry of blk(r) ``need`` was inserted at ``at``: those before it above
    ``need`` (a run just before ``at``, as they never fall) drop to it; its own is min(need, the next)."""
    below = bisect_right(mins, need, 0, at)
    mins[below:at] = [need] * (at - below)
    mins.insert(at, min(need, mins[at]) if at < len(mins) else need)


def _raise_mins(order: list[Entry], mins: list[int], at: int) -> None:
    """``mins`` after the entry at ``at`` was removed (from both): those before it are recomputed
    backwards until one comes out as it was (every one before that is then unchanged too)."""
    last = len(mins) - 1
    for k in range(at - 1, -1, -1):
        low = order[k][3] if k == last else min(order[k][3], mins[k + 1])
        if low == mins[k]:
            return
        mins[k] = low


def rotary_heads(
    order: Sequence[Entry], mins: Sequence[int], now: float, alpha: float, lag_s: float
) -> Generator[Head | None, int, None]:
    """The rotary requests in step 2's order that fit: sent B_left (after a first ``next``), yields
    the next one whose blk(r) is at most it, or None once none is left. B_left only falls, so one
    passed over never fits later: it costs no VLT and no key, and the walk ends where the suffix
    minimum of blk(r) is above B_left (issue 20: most of the rotary requests read do not fit).

    ``order`` is by (t_last, arrival, id), along which the VLT never rises; equal t_last means
    equal VLT, already in (arrival, id) order. A run of equal VLT over several t_last (alpha 0,
    ReLU's zeros, rounding) is sorted by (arrival, id) from the first of it that fits (those before
    it never fit)."""
    left = yield None
    i, n = 0, len(order)
    checked = 0  # order[i:checked] share order[i]'s t_last, and the VLT at ``checked`` is another
    while i < n and mins[i] <= left:
        entry = order[i]
        if entry[3] > left:
            i += 1
            continue
        t_last = entry[0]
        lag = now - t_last - lag_s
        vlt = alpha * (lag if lag > 0.0 else 0.0)  # max(0.0, lag), the same float (RotaSched.vlt)
        if i >= checked:
            j = i + 1
            while j < n and order[j][0] == t_last:
                j += 1
            if j < n:
                lag = now - order[j][0] - lag_s
                if alpha * (lag if lag > 0.0 else 0.0) == vlt:  # a run over several t_last
                    while j < n:
                        lag = now - order[j][0] - lag_s
                        if alpha * (lag if lag > 0.0 else 0.0) != vlt:
                            break
                        j += 1
                    for _, arrival, rid, need, r, _ in sorted(order[i:j], key=_arrival_id):
                        if need <= left:
                            left = yield (-vlt, arrival, rid), need, r
                    i = checked = j
                    continue
            checked = j
        left = yield (-vlt, entry[1], entry[2]), entry[3], entry[4]
        i += 1
    while True:
        yield None


def _unique(views: Sequence[RequestView]) -> bool:
    return len(set(map(id, views))) == len(views)


def _arrival_id(entry: Entry) -> tuple[float, int]:
    return entry[1], entry[2]
