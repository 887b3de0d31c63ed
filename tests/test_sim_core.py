"""Analytic checks of the event core and links: the simulator's answers in closed form."""

from __future__ import annotations

import pytest

from kvtier.errors import SimError
from kvtier.sim.core import EventKind, EventLoop
from kvtier.sim.resources import Direction, Link, StripedLink, Transfer

GB = 1e9


def test_events_run_in_time_then_kind_then_insertion_order() -> None:
    loop = EventLoop()
    seen: list[str] = []
    loop.schedule(1.0, EventKind.ARRIVAL, lambda: seen.append("arrival@1"))
    loop.schedule(1.0, EventKind.TRANSFER_DONE, lambda: seen.append("transfer@1"))
    loop.schedule(0.5, EventKind.WAKE, lambda: seen.append("wake@0.5"))
    loop.schedule(1.0, EventKind.ARRIVAL, lambda: seen.append("arrival@1#2"))
    cancelled = loop.schedule(0.7, EventKind.STEP_END, lambda: seen.append("cancelled"))
    cancelled.cancel()
    loop.run()
    assert seen == ["wake@0.5", "transfer@1", "arrival@1", "arrival@1#2"]
    assert loop.now_s == 1.0


def test_run_until_stops_the_clock() -> None:
    loop = EventLoop()
    seen: list[float] = []
    for t in (1.0, 2.0, 3.0):
        loop.schedule(t, EventKind.WAKE, lambda t=t: seen.append(t))
    loop.run(until_s=2.5)
    assert seen == [1.0, 2.0] and loop.now_s == 2.5


def test_scheduling_in_the_past_is_an_error() -> None:
    loop = EventLoop()
    loop.schedule(1.0, EventKind.WAKE, lambda: None)
    loop.run()
    with pytest.raises(SimError, match="past"):
        loop.schedule(0.5, EventKind.WAKE, lambda: None)


def _finish_times(link: Link, loop: EventLoop, specs: list[tuple[float, int, Direction, int]]) -> list[float]:
    """Submits (start_s, nbytes, direction, priority) transfers; returns each finish time."""
    done: dict[int, float] = {}
    for i, (start, nbytes, direction, priority) in enumerate(specs):

        def submit(
            i: int = i, nbytes: int = nbytes, direction: Direction = direction, priority: int = priority
        ) -> None:
            def finished(t: Transfer) -> None:
                done[i] = loop.now_s

            link.submit(nbytes, direction, finished, priority=priority)

        loop.schedule(start, EventKind.WAKE, submit)
    loop.run()
    return [done[i] for i in range(len(specs))]


def test_a_transfer_alone_takes_bytes_over_bandwidth() -> None:
    loop = EventLoop()
    link = Link(loop, "pcie", 50 * GB, 40 * GB)
    assert _finish_times(link, loop, [(0.0, 10 * 10**9, Direction.IN, 1)]) == pytest.approx([0.2])
    loop2 = EventLoop()
    link2 = Link(loop2, "pcie", 50 * GB, 40 * GB)
    assert _finish_times(link2, loop2, [(0.0, 10 * 10**9, Direction.OUT, 1)]) == pytest.approx([0.25])


def test_two_equal_transfers_take_twice_as_long() -> None:
    loop = EventLoop()
    link = Link(loop, "pcie", 50 * GB, 50 * GB)
    times = _finish_times(link, loop, [(0.0, 10**10, Direction.IN, 1), (0.0, 10**10, Direction.IN, 1)])
    assert times == pytest.approx([0.4, 0.4])


def test_late_joiner_shares_then_runs_alone() -> None:
    loop = EventLoop()
    link = Link(loop, "l", 1 * GB, 1 * GB)
    # A: 1 GB from t=0. B: 0.5 GB from t=0.5. A alone 0.5 s (0.5 GB), then both at half rate:
    # B needs 1 s of sharing → both have moved 0.5 GB at t=1.5, A done too.
    times = _finish_times(link, loop, [(0.0, 10**9, Direction.IN, 1), (0.5, 5 * 10**8, Direction.IN, 1)])
    assert times == pytest.approx([1.5, 1.5])


def test_duplex_directions_do_not_interfere_but_half_duplex_do() -> None:
    loop = EventLoop()
    duplex = Link(loop, "pcie", 1 * GB, 1 * GB, duplex=True)
    both = [(0.0, 10**9, Direction.IN, 1), (0.0, 10**9, Direction.OUT, 1)]
    assert _finish_times(duplex, loop, both) == pytest.approx([1.0, 1.0])
    loop2 = EventLoop()
    half = Link(loop2, "ssd", 1 * GB, 1 * GB, duplex=False)
    assert _finish_times(half, loop2, both) == pytest.approx([2.0, 2.0])


def test_shared_duplex_cap_slows_both_directions_only_while_both_run() -> None:
    # 3 + 1 GB/s alone, 2 GB/s in total: both busy, each at half its rate (SuperInfer §3.3's
    # half-duplex Grace DRAM behind a full-duplex C2C link).
    loop = EventLoop()
    link = Link(loop, "c2c", 3 * GB, 1 * GB, duplex=True, duplex_total_bytes_per_s=2 * GB)
    both = [(0.0, 3 * 10**9, Direction.IN, 1), (0.0, 10**9, Direction.OUT, 1)]
    assert _finish_times(link, loop, both) == pytest.approx([2.0, 2.0])
    # OUT starts at 1 s: IN ran alone for 1 s (3 GB), so it is done before OUT joins.
    loop2 = EventLoop()
    link2 = Link(loop2, "c2c", 3 * GB, 1 * GB, duplex=True, duplex_total_bytes_per_s=2 * GB)
    late = [(0.0, 3 * 10**9, Direction.IN, 1), (1.0, 10**9, Direction.OUT, 1)]
    assert _finish_times(link2, loop2, late) == pytest.approx([1.0, 2.0])
    # IN alone 0.5 s (1.5 GB), then both at half rate: OUT needs 2 s, IN's last 1.5 GB 1 s of it.
    loop3 = EventLoop()
    link3 = Link(loop3, "c2c", 3 * GB, 1 * GB, duplex=True, duplex_total_bytes_per_s=2 * GB)
    mixed = [(0.0, 3 * 10**9, Direction.IN, 1), (0.5, 10**9, Direction.OUT, 1)]
    assert _finish_times(link3, loop3, mixed) == pytest.approx([1.5, 2.0])
    # A cap above the sum of the rates changes nothing.
    loop4 = EventLoop()
    link4 = Link(loop4, "c2c", 3 * GB, 1 * GB, duplex=True, duplex_total_bytes_per_s=5 * GB)
    assert _finish_times(link4, loop4, both) == pytest.approx([1.0, 1.0])


def test_priority_class_goes_first() -> None:
    loop = EventLoop()
    link = Link(loop, "nic", 1 * GB, 1 * GB)
    times = _finish_times(link, loop, [(0.0, 10**9, Direction.IN, 2), (0.0, 10**9, Direction.IN, 0)])
    assert times == pytest.approx([2.0, 1.0])  # the urgent one runs alone, the other after it


@pytest.mark.parametrize("priorities", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (3, 2, 1)])
def test_only_the_most_urgent_class_shares_the_link(priorities: tuple[int, int, int]) -> None:
    # 1 GB each at 1 GB/s: the urgent class's transfers share the link, a later class waits for
    # them, whichever order they were submitted in (a class seen first and then outranked).
    loop = EventLoop()
    link = Link(loop, "nic", 1 * GB, 1 * GB)
    times = _finish_times(link, loop, [(0.0, 10**9, Direction.IN, p) for p in priorities])
    expected = {
        (2, 1, 1): [3.0, 2.0, 2.0],
        (1, 2, 1): [2.0, 3.0, 2.0],
        (1, 1, 2): [2.0, 2.0, 3.0],
        (2, 2, 1): [3.0, 3.0, 1.0],
        (3, 2, 1): [3.0, 2.0, 1.0],
    }[priorities]
    assert times == pytest.approx(expected)


def test_per_segment_overhead_makes_small_segments_slow() -> None:
    loop = EventLoop()
    link = Link(loop, "pcie", 50 * GB, 50 * GB, per_segment_overhead_s=5e-6)
    big = link.work_s(2**30, 2**30, Direction.IN)
    small = link.work_s(2**30, 64 * 2**10, Direction.IN)
    assert small - big == pytest.approx((2**30 // (64 * 2**10) - 1) * 5e-6)


def test_per_copy_rate_holds_copies_launched_one_per_segment_not_a_batched_copy() -> None:
    # SuperInfer Table 1: 4 MB copies launched one by one (MS) reach ~80 GB/s D2H where one batched
    # launch for them all (MS+MK) reaches the link's 239 GB/s.
    loop = EventLoop()
    link = Link(
        loop,
        "c2c",
        270 * GB,
        239 * GB,
        per_segment_overhead_s=5.8e-6,
        per_copy_bytes_per_s=(164 * GB, 90 * GB),
    )
    block, n = 4 * 2**20, 2**31
    one_by_one = link.work_s(n, block, Direction.OUT)
    batched = link.work_s(n, n, Direction.OUT, batched=True)
    assert one_by_one == pytest.approx(n / (90 * GB) + n // block * 5.8e-6)
    assert batched == pytest.approx(n / (239 * GB) + 5.8e-6)
    assert link.work_s(n, block, Direction.IN) == pytest.approx(n / (164 * GB) + n // block * 5.8e-6)
    plain = Link(loop, "pcie", 50 * GB, 50 * GB)  # no per-copy rate: every copy at the link's rate
    assert plain.work_s(n, block, Direction.IN) == plain.work_s(n, block, Direction.IN, batched=True)


def test_bad_link_parameters() -> None:
    with pytest.raises(SimError, match="positive bandwidth"):
        Link(EventLoop(), "x", 0.0, 1.0)
    with pytest.raises(SimError, match="overhead"):
        Link(EventLoop(), "x", 1.0, 1.0, per_segment_overhead_s=-1)
    with pytest.raises(SimError, match="per_copy_bytes_per_s"):
        Link(EventLoop(), "x", 1.0, 1.0, per_copy_bytes_per_s=(-1.0, 1.0))


def test_striped_devices_split_a_transfer_and_keep_their_own_queues() -> None:
    loop = EventLoop()
    devices = [Link(loop, f"ssd{i}", 1 * GB, 1 * GB, duplex=False) for i in range(2)]
    striped = StripedLink("ssd", devices)
    done: list[float] = []
    striped.submit(10**9, Direction.IN, lambda t: done.append(loop.now_s))
    loop.run()
    assert done == pytest.approx([0.5])  # two devices, half each
    assert [d.bytes_moved[Direction.IN] for d in devices] == [5 * 10**8, 5 * 10**8]
    assert striped.work_s(10**9, 10**9, Direction.IN) == pytest.approx(0.5)
