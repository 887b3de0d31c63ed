"""prefix_counts (the scheduler view's lookup) is match() counted per tier, on random trees."""

from __future__ import annotations

import random

import pytest

from kvtier.errors import SimError
from kvtier.radix import HiRadixTree
from kvtier.radix.counts import prefix_counts
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
