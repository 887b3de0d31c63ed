"""A prompt's cached prefix counted per tier, without the per-block list (issue 20).

:func:`prefix_counts` walks the tree exactly as :meth:`HiRadixTree.match` does without ``now_s``
(nothing is touched) and returns only what a scheduler view needs of the result: how many blocks of
the resident run each tier serves (by the fastest tier holding each block) and the in-queue /
in-flight counts of the marked run after the device prefix. A waiting request's view needs one per
step, so it skips building the per-block tier tuple and the :class:`Match`;
:func:`watched_prefix_counts` also returns a :class:`~kvtier.radix.watch.Watch` of what it read,
which, armed, says when the counts could have changed (a waiting request's are kept across steps).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.radix.tree import _FASTEST_OF_MASK, HiRadixTree, _Node
from kvtier.radix.watch import CHILD, MARKS, RESIDENCY, Watch
from kvtier.tiers import Tier

_DEVICE = Tier.DEVICE


def prefix_counts(
    tree: HiRadixTree, keys: Sequence[int], own_queue_marks: int = 0
) -> tuple[list[int], int, int]:
    """(blocks per tier, in-queue blocks, in-flight blocks): ``match(keys, own_queue_marks=...)``'s
    ``tiers`` counted per tier, and its ``in_queue_blocks`` / ``in_flight_blocks``."""
    return watched_prefix_counts(tree, keys, own_queue_marks)[0]


def watched_prefix_counts(
    tree: HiRadixTree, keys: Sequence[int], own_queue_marks: int = 0
) -> tuple[tuple[list[int], int, int], Watch]:
    """:func:`prefix_counts`, and a :class:`Watch` of what the walk read: armed (:meth:`Watch.arm`)
    right away, it stays valid while the counts would come out the same.

    Each node visited is recorded with what was read of it (the device run: its fastest tier; after
    it: its fastest tier while the resident run lasts, its marks while the marked run lasts; where a
    missing child ended the walk: that child).
    """
    # The device run first, in its own loop (most of a waiting request's path): only the tier is read.
    fastest_of = _FASTEST_OF_MASK
    node = tree._root
    keys_left = iter(keys)
    device = 0
    fastest: Tier | None = None
    run: list[_Node] = []  # the device run and the node ending it
    reads: list[tuple[_Node, int]] = []
    visit = run.append
    for key in keys_left:
        if (child := node.children.get(key)) is None:
            reads.append((node, CHILD))
            return ([device, 0, 0, 0], 0, 0), Watch(run, reads)
        visit(node := child)
        if (fastest := fastest_of[node.residency]) is not _DEVICE:
            break
        device += 1
    else:
        return ([device, 0, 0, 0], 0, 0), Watch(run, reads)
    # ``node`` ends the device run; from it on, the resident run and the marked run.
    per_tier = [device, 0, 0, 0]
    in_queue = in_flight = 0
    resident = fastest is not None
    if fastest is not None:
        per_tier[fastest] += 1
    reads.append((node, MARKS))
    marked = bool((queued := node.in_queue > own_queue_marks) or node.in_flight)
    if marked:
        in_queue += queued
        in_flight += node.in_flight > 0
    for key in keys_left:
        if not (resident or marked):
            break
        if (child := node.children.get(key)) is None:
            reads.append((node, CHILD))
            break
        node = child
        reads.append((node, (RESIDENCY if resident else 0) | (MARKS if marked else 0)))
        if resident:
            if (fastest := fastest_of[node.residency]) is None:
                resident = False
            else:
                per_tier[fastest] += 1
        if marked and (marked := bool((queued := node.in_queue > own_queue_marks) or node.in_flight)):
            in_queue += queued
            in_flight += node.in_flight > 0
    return (per_tier, in_queue, in_flight), Watch(run, reads)
