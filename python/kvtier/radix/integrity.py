"""One node's invariants, for :meth:`kvtier.radix.HiRadixTree.check_integrity` (the tree's module
docstring lists them): lock and mark counts, pruning, lock sums, LRU membership and order."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, TypeVar

from kvtier.errors import IntegrityError
from kvtier.tiers import Tier

_ALL_TIERS = tuple(Tier)


class CheckedNode(Protocol):
    """A tree node as the check reads it (:class:`kvtier.radix.tree._Node`)."""

    @property
    def key(self) -> int: ...
    @property
    def lock(self) -> int: ...
    @property
    def child_locks(self) -> int: ...
    @property
    def in_queue(self) -> int: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def residency(self) -> int: ...
    @property
    def children(self) -> Mapping[int, CheckedNode]: ...
    def prunable(self) -> bool: ...


N = TypeVar("N", bound=CheckedNode)


def check_node(
    node: N,
    position: list[dict[N, int]],
    ancestor_pos: tuple[int | None, ...],
    counts: list[int],
    listed_counts: list[int],
) -> None:
    """Raises :class:`IntegrityError` naming what ``node`` breaks; counts its residency and LRU
    membership per tier into ``counts`` / ``listed_counts``. ``position[t]``: each node's place in
    tier ``t``'s LRU; ``ancestor_pos[t]``: that of its nearest ancestor listed there."""
    if node.lock < 0 or node.in_queue < 0 or node.in_flight < 0:
        raise IntegrityError(f"node {node.key}: negative lock or mark count")
    if node.prunable():
        raise IntegrityError(f"node {node.key} holds nothing and should have been pruned")
    if (
        node.child_locks != sum(child.lock for child in node.children.values())
        or node.lock < node.child_locks
    ):
        raise IntegrityError(f"node {node.key}: lock {node.lock} disagrees with its children's")
    for t, tier in enumerate(_ALL_TIERS):
        resident = bool(node.residency >> t & 1)
        counts[t] += resident
        listed = node in position[t]
        listed_counts[t] += listed
        if listed != (resident and not node.lock):
            raise IntegrityError(f"node {node.key}: in {tier.label} LRU is {listed}")
        above = ancestor_pos[t]
        if listed and above is not None and position[t][node] > above:
            raise IntegrityError(f"node {node.key}: after an ancestor in the {tier.label} LRU")
