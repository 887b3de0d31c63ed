"""A prompt's cached prefix counted per tier, without the per-block list (issue 20).

:func:`prefix_counts` walks the tree exactly as :meth:`HiRadixTree.match` does without ``now_s``
(nothing is touched) and returns only what a scheduler view needs of the result: how many blocks of
the resident run each tier serves (by the fastest tier holding each block) and the in-queue /
in-flight counts of the marked run after the device prefix. A waiting request's view needs one per
step, so it skips building the per-block tier tuple and the :class:`Match`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.radix.tree import _FASTEST_OF_MASK, HiRadixTree
from kvtier.tiers import Tier

_DEVICE = Tier.DEVICE


def prefix_counts(
    tree: HiRadixTree, keys: Sequence[int], own_queue_marks: int = 0
) -> tuple[list[int], int, int]:
    """(blocks per tier, in-queue blocks, in-flight blocks): ``match(keys, own_queue_marks=...)``'s
    ``tiers`` counted per tier, and its ``in_queue_blocks`` / ``in_flight_blocks``."""
    # The device run first, in its own loop (most of a waiting request's path): only the tier is read.
    fastest_of = _FASTEST_OF_MASK
    node = tree._root
    keys_left = iter(keys)
    device = 0
    fastest: Tier | None = None
    for key in keys_left:
        if (child := node.children.get(key)) is None:
            return [device, 0, 0, 0], 0, 0
        node = child
        if (fastest := fastest_of[node.residency]) is not _DEVICE:
            break
        device += 1
    else:
        return [device, 0, 0, 0], 0, 0
    # ``node`` ends the device run; from it on, the resident run and the marked run.
    per_tier = [device, 0, 0, 0]
    in_queue = in_flight = 0
    resident = fastest is not None
    if fastest is not None:
        per_tier[fastest] += 1
    marked = bool((queued := node.in_queue > own_queue_marks) or node.in_flight)
    if marked:
        in_queue += queued
        in_flight += node.in_flight > 0
    for key in keys_left:
        if not (resident or marked) or (child := node.children.get(key)) is None:
            break
        node = child
        if resident:
            if (fastest := fastest_of[node.residency]) is None:
                resident = False
            else:
                per_tier[fastest] += 1
        if marked and (marked := bool((queued := node.in_queue > own_queue_marks) or node.in_flight)):
            in_queue += queued
            in_flight += node.in_flight > 0
    return per_tier, in_queue, in_flight
