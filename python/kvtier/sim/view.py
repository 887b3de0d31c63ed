"""The :class:`~kvtier.sched.SchedulerView` a simulated engine shows its policy, built from its state
(as :mod:`kvtier.engine.view` builds it for the reference engine).

Requests become :class:`~kvtier.sched.RequestView`; a request not admitted yet also gets its cached
prefix per tier from the prefix index, capped at the whole blocks before its last prompt token (at
least one token is computed: it yields the first new token's logits), and the blocks of it that a
queued or running request is bringing (in-queue, in-flight). Swapped requests whose copy is still in
flight are not shown: there is nothing to order for them yet.

Incremental, so that a step costs what the policy reads, not the queue's length (issue 20): the
waiting requests' views (each a prefix lookup) are built when the policy first reads them
(:class:`WaitingViews`; FCFS policies stop at the first request that does not fit), and an admitted
request's view is kept on the request and rebuilt only when its phase or token counts changed (a
swapped request's view is the same step after step). A waiting request's view is kept too, with a
:class:`~kvtier.radix.watch.Watch` on the prefix-index nodes its lookup read: the index changes every
step, but rarely along a given waiting request's path (one lookup in ~170 found other counts on the
bundled trace under ``strata``), and the watch is released exactly when it did. The head's views
as a whole are kept across steps too (the engine's ``waiting_version``, bumped when the queue
changes or a waiting request's watch is released): a step where neither happened reads the last
step's list as it is, without asking each watch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import chain
from typing import Any, Protocol, cast, overload

from kvtier.errors import SimError
from kvtier.radix import HiRadixTree
from kvtier.radix.counts import watched_prefix_counts
from kvtier.sched.base import LoadMode, RequestView, SchedulerView
from kvtier.sched.fetch_path import FetchPath
from kvtier.sched.shown import ShownViews
from kvtier.sched.swap_copy import SwapCopy
from kvtier.sched.view_fill import UnfrozenRequestView, UnfrozenSchedulerView
from kvtier.sim.core import EventLoop
from kvtier.sim.cost import CostModel
from kvtier.sim.loads import LoadPaths
from kvtier.sim.owner import StepSizes
from kvtier.sim.state import SimRequest
from kvtier.sim.tiers import LowerTiers
from kvtier.tiers import NO_TOKENS, PerTier, Tier

_object_new = object.__new__
_tuple_new = tuple.__new__  # PerTier(...) without its Python-level __new__


class ViewConfig(StepSizes, Protocol):
    @property
    def host_blocks(self) -> int: ...
    @property
    def view_waiting_max(self) -> int: ...
    @property
    def swap_copy(self) -> SwapCopy: ...
    @property
    def fetch(self) -> FetchPath: ...


class ViewedEngine(Protocol):
    """What the view reads of the engine (:class:`kvtier.sim.engine.Engine`)."""

    @property
    def loop(self) -> EventLoop: ...
    @property
    def config(self) -> ViewConfig: ...
    @property
    def cost(self) -> CostModel: ...
    @property
    def tree(self) -> HiRadixTree: ...
    @property
    def load_paths(self) -> LoadPaths: ...
    @property
    def requests(self) -> Mapping[int, SimRequest]: ...
    @property
    def waiting(self) -> Sequence[tuple[float, int]]: ...
    @property
    def running(self) -> Sequence[SimRequest]: ...
    @property
    def fetching(self) -> Mapping[int, SimRequest]: ...
    @property
    def swapped_views(self) -> SwappedViews: ...  # kept by the swaps (kvtier.sim.swap)

    @property
    def waiting_version(self) -> int: ...  # bumped when the waiting queue or a waiting watch changes

    waiting_views: WaitingViews | None  # the last step's head (its views valid at its version)

    def waiting_changed(self) -> None: ...  # bumps waiting_version

    def available_device_blocks(self) -> int: ...

    @property
    def lower_tiers(self) -> LowerTiers: ...


class WaitingViews(Sequence[RequestView]):
    """The waiting queue's head as request views, each built on its first read.

    Valid while the policy decides the step it was built for: the engine calls :meth:`close` once
    the decision is back, and a later read raises (it would see the prefix index of a later step).
    A later step whose engine is still at ``version`` takes its views as they are (:meth:`again`).
    """

    __slots__ = ("_block_tokens", "_built", "_changed", "_engine", "_requests", "_tree", "_views", "version")

    def __init__(self, engine: ViewedEngine, requests: list[SimRequest]) -> None:
        self._engine: ViewedEngine | None = engine
        self._tree, self._block_tokens = engine.tree, engine.config.block_tokens
        self._changed = engine.waiting_changed  # each new watch's on_release
        self._requests = requests
        self._views: list[RequestView | None] = [None] * len(requests)
        self._built = 0  # views built so far (all of them: iterate the list itself)
        self.version = engine.waiting_version  # what the views are valid for

    def again(self, engine: ViewedEngine) -> WaitingViews:
        """The head at a later step of an engine still at :attr:`version` (the same requests, and
        nothing any view read changed since): this one's views, built or not, in a list both share
        (this one is closed: only the new one builds more)."""
        w = WaitingViews(engine, [])  # a constructor (a class compiled by mypyc refuses object.__new__)
        w._tree, w._block_tokens = self._tree, self._block_tokens
        w._changed, w._requests, w._views = self._changed, self._requests, self._views
        w._built, w.version = self._built, self.version
        return w

    def close(self) -> None:
        self._engine = None

    def __len__(self) -> int:
        return len(self._requests)

    @overload
    def __getitem__(self, i: int) -> RequestView: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[RequestView, ...]: ...
    def __getitem__(self, i: int | slice) -> RequestView | tuple[RequestView, ...]:
        if isinstance(i, slice):
            return tuple(self._get(j) for j in range(*i.indices(len(self._requests))))
        if i < 0:
            i += len(self._requests)
        if not 0 <= i < len(self._requests):
            raise IndexError("waiting view index out of range")
        return self._get(i)

    def __iter__(self) -> Iterator[RequestView]:
        views = self._views
        if self._built == len(views):  # a policy reading the head again (Strata: 3 times)
            return iter(cast("list[RequestView]", views))
        if self._engine is None:
            return self._iter_building(0)  # raises at the first view not built
        first = self._fill_kept()
        if first == len(views):
            return iter(cast("list[RequestView]", views))
        return chain(cast("list[RequestView]", views[:first]), self._iter_building(first))

    def _fill_kept(self) -> int:
        """Sets every view not built yet that its request keeps (admitted, or waiting under a valid
        watch: no lookup, nothing else changes), as reading it would; returns the index of the
        first one still to build (a lookup each: built when read). A head built anew after one
        request was admitted keeps the rest of its views: iterating it then costs no Python step
        per view up to the first new one (issue 20)."""
        views, first = self._views, len(self._views)
        for i, r in enumerate(self._requests):
            if views[i] is None:
                if r.admitted:
                    views[i] = admitted_view(r)
                elif (w := r.watch) is not None and w.valid and r.waiting_view is not None:
                    views[i] = r.waiting_view
                else:
                    first = i if i < first else first
                    continue
                self._built += 1
        return first

    def _iter_building(self, start: int) -> Iterator[RequestView]:
        views, requests, tree, bt = self._views, self._requests, self._tree, self._block_tokens
        changed = self._changed
        for i in range(start, len(views)):
            view = views[i]
            if view is None:  # _get inline (Strata reads the whole head every step)
                if self._engine is None:
                    raise SimError("a waiting request's view was read after the step it was built for")
                r = requests[i]
                if r.admitted:
                    view = admitted_view(r)
                elif (w := r.watch) is not None and w.valid and r.waiting_view is not None:
                    view = r.waiting_view  # waiting_view's reuse inline
                else:
                    view = waiting_view(tree, bt, r, changed)
                views[i] = view
                self._built += 1
            yield view

    def _get(self, i: int) -> RequestView:
        view = self._views[i]
        if view is None:
            if self._engine is None:
                raise SimError("a waiting request's view was read after the step it was built for")
            r = self._requests[i]
            view = self._views[i] = (
                admitted_view(r)
                if r.admitted
                else waiting_view(self._tree, self._block_tokens, r, self._changed)
            )
            self._built += 1
        return view


class SwappedViews:
    """The swapped requests whose copy has landed, as views, in the engine's ``swapped`` order (the
    order their swap-outs were issued in): kept by the swaps as each one changes, so that a step
    costs nothing per swapped request. Up to a few hundred swapped requests sit out every step of a
    swapping policy, which swaps some in and out at every step.

    One entry per swapped request, in ``swapped``'s order: its view once its swap-out has landed,
    ``None`` while a copy is in flight (a swap-out issued, or a swap-in: not shown, nothing to order
    for it). A swapped request's phase and token counts stay while it is swapped, so its view does;
    the tuple shown is rebuilt (in C: ``filter``) only when an entry changed, as a
    :class:`~kvtier.sched.shown.ShownViews` that says which views it added and removed since the
    last one built (from each changed entry's value in that one, recorded at its first change), so
    that a policy keeping state per swapped request reads what changed, not the whole tuple.
    """

    __slots__ = ("_before", "_entries", "_issued", "_last", "_order", "_shown", "_visible", "_visible_last")

    def __init__(self) -> None:
        self._entries: dict[int, RequestView | None] = {}
        self._shown: tuple[RequestView, ...] | None = ()  # None: rebuilt on the next read
        self._last: ShownViews | None = None  # the last tuple built
        # Requests whose entry changed since _last was built: their entry then (None: not shown).
        self._before: dict[int, RequestView | None] = {}
        # The entries shown, in their order, kept as they change (the tuple is built from its values,
        # not by filtering every entry); None: rebuilt from _entries on the next read, where a copy
        # landed ahead of one shown (swap-outs land in the order they were issued, mostly).
        self._visible: dict[int, RequestView] | None = {}
        self._order: dict[int, int] = {}  # request id -> the number of its swap-out, in issue order
        self._issued = 0  # swap-outs issued
        self._visible_last = -1  # the number of the last entry put in _visible (or more)

    def _set(self, rid: int, entry: RequestView | None) -> None:
        before = self._before
        if rid not in before:
            before[rid] = self._entries.get(rid)
        self._entries[rid] = entry

    def issued(self, r: SimRequest) -> None:
        """``r``'s swap-out was issued: it joins ``swapped`` (last), not shown yet."""
        if r.req_id in self._entries:
            raise SimError(f"request {r.req_id} is swapped out twice")
        self._set(r.req_id, None)
        self._order[r.req_id] = self._issued
        self._issued += 1

    def landed(self, r: SimRequest) -> None:
        """``r``'s swap-out landed: shown from now on, as its view (an admitted request's)."""
        if not r.admitted:
            raise SimError(f"swapped request {r.req_id} was never admitted")
        view = admitted_view(r)
        self._set(r.req_id, view)
        if self._visible is not None:
            number = self._order[r.req_id]
            if number > self._visible_last:  # after every entry shown: last in their order
                self._visible[r.req_id] = view
                self._visible_last = number
            else:
                self._visible = None
        self._shown = None

    def hidden(self, r: SimRequest) -> None:
        """``r``'s swap-in was issued: not shown (it stays in ``swapped``, in its place, until it lands)."""
        self._set(r.req_id, None)
        if self._visible is not None:
            self._visible.pop(r.req_id, None)
        self._shown = None

    def left(self, r: SimRequest) -> None:
        """``r``'s swap-in landed: it leaves ``swapped`` (it was hidden already: the tuple stays)."""
        self._set(r.req_id, None)
        if self._entries.pop(r.req_id) is not None:
            raise SimError(f"request {r.req_id} left the swapped set while shown")
        del self._order[r.req_id]

    def views(self) -> tuple[RequestView, ...]:
        shown = self._shown
        if shown is None:
            visible, entries = self._visible, self._entries
            if visible is None:
                visible = self._visible = {rid: v for rid, v in entries.items() if v is not None}
                self._visible_last = self._order[next(reversed(visible))] if visible else -1
            built = ShownViews(visible.values())
            added, removed = [], []
            for rid, before in self._before.items():
                now = entries.get(rid)
                if now is not before:
                    if before is not None:
                        removed.append(before)
                    if now is not None:
                        added.append(now)
            self._before.clear()
            last = self._last
            if last is not None:
                last.base = None  # only the last link is kept
            built.base, built.added, built.removed = last, tuple(added), tuple(removed)
            shown = self._shown = self._last = built
        return shown


def build_view(engine: ViewedEngine) -> SchedulerView:
    config = engine.config
    kept = engine.waiting_views
    if kept is not None and kept.version == engine.waiting_version:
        waiting = kept.again(engine)
    else:
        requests = engine.requests
        waiting = WaitingViews(
            engine, [requests[rid] for _, rid in engine.waiting[: config.view_waiting_max]]
        )
    engine.waiting_views = waiting
    cost = engine.cost
    # SchedulerView(...) filled slot by slot (kvtier.sched.view_fill: its frozen __init__ costs 4x).
    v: Any = _object_new(UnfrozenSchedulerView)  # its slots' types are SchedulerView's (checked: tests/sim)
    v.now_s = engine.loop.now_s
    v.waiting = waiting
    v.running = _views(engine, engine.running)
    v.fetching = _views(engine, engine.fetching.values())
    v.swapped = engine.swapped_views.views()
    v.free_device_blocks = engine.available_device_blocks()
    # The host room a swap-out can take (as the reference engine's free swap space), not the host
    # tier's free blocks: swapped KV shrinks the tier, and its cache gives way to a swap.
    v.free_host_blocks = engine.lower_tiers.swap_room() if config.host_blocks else None
    v.block_tokens = config.block_tokens
    v.max_batch_tokens = config.max_batch_tokens
    v.max_running = config.max_running
    v.num_layers = cost.num_layers
    v.cost = Estimates(cost, engine.load_paths)
    v.kv_bytes_per_token = cost.kv_bytes_per_token
    v.swap_copy = config.swap_copy
    v.fetch = config.fetch
    v.layerwise_prefill = False
    v.__class__ = SchedulerView  # same slots: a SchedulerView from here
    return v  # type: ignore[no-any-return]


def _views(engine: ViewedEngine, requests: Iterable[SimRequest]) -> tuple[RequestView, ...]:
    """``request_view`` of each, with :func:`admitted_view`'s check and :func:`_view` inline (one per
    running request per step: a decoding request's view changes at every step)."""
    out: list[RequestView] = []
    append = out.append
    for r in requests:
        if not r.admitted:
            append(request_view(engine, r))
            continue
        v = r.view
        if (  # generated_tokens first: a decoding request's, the one that changes every step
            v is None
            or v.generated_tokens != r.generated_tokens
            or v.computed_tokens != r.computed_tokens
            or v.phase is not r.phase
        ):
            new = _object_new(UnfrozenRequestView)  # _view(r, NO_TOKENS, 0, 0), inline
            new.req_id, new.arrival_s, new.phase = r.req_id, r.arrival_s, r.phase
            new.prompt_tokens, new.computed_tokens = r.prompt_tokens, r.computed_tokens
            new.generated_tokens, new.cached_tokens = r.generated_tokens, NO_TOKENS
            new.in_queue_tokens = new.in_flight_tokens = 0
            new.block_keys = r.keys
            new.__class__ = RequestView  # type: ignore[assignment]  # same slots: a RequestView
            r.view = new  # type: ignore[assignment]
            append(new)  # type: ignore[arg-type]
            continue
        append(v)
    return tuple(out)


def admitted_view(r: SimRequest) -> RequestView:
    """An admitted request's view: kept on the request while its phase and token counts stay."""
    view = r.view
    if (
        view is not None
        and view.phase is r.phase
        and view.computed_tokens == r.computed_tokens
        and view.generated_tokens == r.generated_tokens
    ):
        return view
    view = r.view = _view(r, NO_TOKENS, 0, 0)
    return view


def request_view(engine: ViewedEngine, r: SimRequest) -> RequestView:
    if r.admitted:
        return admitted_view(r)
    return waiting_view(engine.tree, engine.config.block_tokens, r, engine.waiting_changed)


def waiting_view(tree: HiRadixTree, bt: int, r: SimRequest, on_release: Callable[[], None]) -> RequestView:
    """A request not admitted yet: its cached prefix per tier, and the marked blocks after it.

    Kept while its watch is valid (nothing its lookup read changed; its phase and token counts do
    not change while it waits, and admission forgets it: :func:`forget_waiting_view`). A lookup
    that finds what the previous one found keeps the previous view object. ``on_release`` is called
    when the new watch is released (the engine's ``waiting_changed``: the kept head is stale).
    """
    v = r.waiting_view
    w = r.watch
    if w is not None:
        if w.valid and v is not None:
            return v
        w.release()
    (per_tier, in_queue, in_flight), w = watched_prefix_counts(tree, r.keys, r.queue_marked)
    w.arm()
    w.on_release = on_release
    r.watch = w
    req = r.req
    # cap_prefix on the block counts: whole blocks before the last prompt token, fastest tier first.
    left = (req.prompt_tokens - 1) // bt
    on_device, on_host, on_ssd, on_remote = per_tier  # indexed by Tier, fastest first
    d = (on_device if on_device < left else left) if left > 0 else 0
    h = (on_host if on_host < left - d else left - d) if left > d else 0
    left -= d + h
    s = (on_ssd if on_ssd < left else left) if left > 0 else 0
    m = (on_remote if on_remote < left - s else left - s) if left > s else 0
    cached, in_queue, in_flight = (d * bt, h * bt, s * bt, m * bt), in_queue * bt, in_flight * bt
    if (
        v is not None
        and v.cached_tokens == cached
        and v.in_queue_tokens == in_queue
        and v.in_flight_tokens == in_flight
        and v.phase is r.phase
        and v.computed_tokens == r.computed_tokens
        and v.generated_tokens == r.generated_tokens
    ):
        return v  # the same view object: a policy comparing views sees it unchanged
    v = r.waiting_view = _view(r, _tuple_new(PerTier, cached), in_queue, in_flight)
    return v


def forget_waiting_view(r: SimRequest) -> None:
    """``r`` left the waiting queue: its waiting view and the watch behind it go (an armed watch's
    registrations would otherwise stay on the nodes it read)."""
    if r.watch is not None:
        r.watch.release()
    r.watch = r.waiting_view = None


def _view(r: SimRequest, cached: PerTier, in_queue: int, in_flight: int) -> RequestView:
    """A new :class:`RequestView`, its slots set directly (the frozen dataclass's ``__init__`` costs
    five times as much; one per decoding request per step): filled as an
    :class:`~kvtier.sched.view_fill.UnfrozenRequestView`."""
    req = r.req
    v: UnfrozenRequestView = _object_new(UnfrozenRequestView)
    v.req_id = req.req_id
    v.arrival_s = req.arrival_s
    v.phase = r.phase
    v.prompt_tokens = req.prompt_tokens
    v.computed_tokens = r.computed_tokens
    v.generated_tokens = r.generated_tokens
    v.cached_tokens = cached
    v.in_queue_tokens = in_queue
    v.in_flight_tokens = in_flight
    v.block_keys = req.block_keys
    v.__class__ = RequestView  # type: ignore[assignment]  # same slots: it is a RequestView from here
    return v  # type: ignore[return-value]  # (no cast(): a call per view)


def cap_prefix(per_tier: list[int], prompt_tokens: int, block_tokens: int) -> PerTier:
    """Caps a cached prefix (tokens per tier, fastest first) at the whole blocks before the last
    prompt token: at least one token is computed, and KV is reused in whole blocks."""
    left = (prompt_tokens - 1) // block_tokens * block_tokens
    out = []
    for t in per_tier:
        take = min(t, max(left, 0))
        out.append(take)
        left -= take
    return PerTier(*out)


class Estimates:
    """Cost estimates offered to policies (no simulator objects leak through)."""

    def __init__(self, cost: CostModel, load_paths: LoadPaths) -> None:
        self._cost = cost
        self._load_paths = load_paths

    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        return self._cost.prefill_time_s(new_tokens, context_tokens)

    def load_s(self, tokens: int, tier: Tier, mode: LoadMode) -> float:
        return self._load_paths.estimate_s(tokens, tier, mode)
