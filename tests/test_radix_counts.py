"""prefix_counts (the scheduler view's lookup) is match() counted per tier, on random trees; its watch
is released whenever the counts could have changed."""

from __future__ import annotations

import random

import pytest

from kvtier.errors import SimError
from kvtier.radix import HiRadixTree
from kvtier.radix.counts import prefix_counts, watched_prefix_counts
from kvtier.radix.tree import _Node
from kvtier.radix.watch import Watch
from kvtier.tiers import Tier


@pytest.mark.parametrize("seed", range(20))
def test_prefix_counts_equal_match_counted_per_tier(seed: int) -> None:
    rng = random.Random(seed)
    tree = HiRadixTree({Tier.DEVICE: 40, Tier.HOST: 60, Tier.SSD: None, Tier.REMOTE: 30})
    paths = [tuple(rng.randrange(4) for _ in range(rng.randrange(1, 12))) for _ in range(40)]
    checked = 0
    for now, p in enumerate(paths):
        op = rng.randrange(5)
        try:
            if op <= 1:
                tree.insert(p, Tier(rng.randrange(4)), float(now))
            elif op == 2:
                tree.mark_in_queue(p, True)
            elif op == 3:
                tree.mark_in_flight(p, True, start=rng.randrange(len(p) + 1))
            else:
                tree.evict(Tier.DEVICE, rng.randrange(5), demote_to=Tier.HOST)
        except SimError:
            pass  # a tier too full for this path: the tree is unchanged
        for q in paths:
            for own in (0, 1):
                m = tree.match(q, own_queue_marks=own)
                per_tier = [0, 0, 0, 0]
                for t in m.tiers:
                    per_tier[t] += 1
                got = prefix_counts(tree, q, own)
                assert got == (per_tier, m.in_queue_blocks, m.in_flight_blocks)
                checked += sum(per_tier) + m.in_queue_blocks + m.in_flight_blocks > 0
    assert checked > 0  # some lookups found something


@pytest.mark.parametrize("seed", range(30))
def test_a_valid_watch_means_the_counts_are_unchanged(seed: int) -> None:
    """Every tree operation, random paths: a watch still valid after it guards counts equal to a
    fresh walk's, and both kept and released watches occur (the test can fail both ways)."""
    rng = random.Random(seed)
    tree = HiRadixTree({Tier.DEVICE: 30, Tier.HOST: 45, Tier.SSD: None, Tier.REMOTE: 20})
    paths = [tuple(rng.randrange(3) for _ in range(rng.randrange(1, 10))) for _ in range(30)]
    held: dict[tuple[tuple[int, ...], int], tuple[tuple[list[int], int, int], Watch]] = {}
    marked: list[tuple[tuple[int, ...], str, int]] = []
    locked: list[tuple[int, ...]] = []
    kept = released = 0
    for now in range(300):
        p = rng.choice(paths)
        op = rng.randrange(9)
        try:
            if op <= 1:
                tree.insert(p, Tier(rng.randrange(4)), float(now), start=rng.randrange(len(p) + 1))
            elif op == 2:
                field, start = rng.choice(("in_queue", "in_flight")), rng.randrange(len(p) + 1)
                getattr(tree, f"mark_{field}")(p, True, start=start)
                marked.append((p, field, start))
            elif op == 3 and marked:
                q, field, start = marked.pop(rng.randrange(len(marked)))
                getattr(tree, f"mark_{field}")(q, False, start=start)
            elif op == 4:
                tier = Tier(rng.randrange(4))  # demoted to a faster tier too (allowed)
                tree.evict(
                    tier, rng.randrange(4), rng.choice([d for d in (None, Tier.HOST, Tier.SSD) if d != tier])
                )
            elif op == 5:
                tree.lock(p)
                locked.append(p)
            elif op == 6 and locked:
                tree.unlock(locked.pop(rng.randrange(len(locked))))
            elif op == 7:
                tree.remove_residency(p, Tier(rng.randrange(1, 4)))
            else:
                tree.evict(Tier.DEVICE, rng.randrange(3), demote_to=Tier.HOST)
        except SimError:
            pass  # a tier too full or a locked block: the tree is unchanged
        tree.check_integrity()
        for q in paths:
            for own in (0, 1):
                fresh = prefix_counts(tree, q, own)
                if (q, own) in held and held[q, own][1].valid:
                    assert held[q, own][0] == fresh, (q, own)
                    kept += 1
                else:
                    released += (q, own) in held
                    held[q, own] = watched_prefix_counts(tree, q, own)
                    assert held[q, own][0] == fresh
                    held[q, own][1].arm()
    assert kept > 1000 and released > 100, (kept, released)


def test_a_released_watch_leaves_no_registration() -> None:
    tree = HiRadixTree({Tier.DEVICE: None, Tier.HOST: None, Tier.SSD: None})
    tree.insert((1, 2, 3), Tier.DEVICE, 0.0)
    tree.insert((1, 2, 3, 4), Tier.HOST, 1.0)
    _, watch = watched_prefix_counts(tree, (1, 2, 3, 4, 5))
    assert not watch.valid and all(node.watch is None for node in _nodes(tree))  # not armed yet
    watch.arm()
    released: list[int] = []
    watch.on_release = lambda: released.append(1)  # the sim engine's waiting_changed
    assert watch.valid and len(watch.nodes) == 4
    with pytest.raises(RuntimeError):
        watch.arm()
    tree.insert((1, 2, 3), Tier.HOST, 2.0)  # the device run keeps the device fastest: still valid
    assert watch.valid
    tree.mark_in_queue((1, 2), True)  # marks inside the device run are not read
    assert watch.valid and released == []
    tree.insert((1, 2, 3, 4, 5), Tier.SSD, 3.0)  # the child the walk missed appears
    assert not watch.valid and watch.nodes == [] and released == [1]
    watch.release()  # released again: on_release was called once
    assert released == [1]
    assert all(node.watch is None for node in _nodes(tree))  # no empty dicts left behind


def _nodes(tree: HiRadixTree) -> list[_Node]:
    out, stack = [], [tree._root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out
