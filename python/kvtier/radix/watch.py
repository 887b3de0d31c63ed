"""Watches on the prefix tree: a result computed from some nodes stays valid until one of them
changes what it was read for (issue 20).

A waiting request's prefix counts (:func:`kvtier.radix.counts.watched_prefix_counts`) read a few
things of each node on its path: whether its fastest tier is the device, which tier is its fastest,
its in-queue / in-flight marks, whether a child exists. The walk records them in a :class:`Watch`;
:meth:`Watch.arm` registers it on each of those nodes with what it read there (:data:`RESIDENCY`,
:data:`MARKS`, :data:`CHILD`), and the tree calls :func:`notify` when a node's fastest tier or marks
change, when a child is added under it and when it is pruned, which releases every armed watch that
read what changed. A released watch is invalid for good (and unregistered from all its nodes); one
that is never notified can be kept across any number of steps. So a waiting request's counts are
recomputed when the tree changed along its path, not every step (Strata reads its whole waiting
head each step). A walk whose result is used once (:func:`kvtier.radix.counts.prefix_counts`)
does not arm its watch: nothing is registered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

RESIDENCY = 1  # the node's fastest tier (whether it is the device, or which one)
MARKS = 2  # the node's in-queue / in-flight mark counts
CHILD = 4  # whether the node has a child under the next key (a walk that stopped there)
PRUNED = RESIDENCY | MARKS | CHILD  # the node left the tree: everything read of it is gone


class Watched(Protocol):
    """A tree node as watches see it (:class:`kvtier.radix.tree._Node`)."""

    watch: dict[Watch, int] | None  # armed watches -> what each read of the node


class Watch:
    """What a walk read of the tree: the nodes of its run (each read for :data:`RESIDENCY`) and
    other reads (a node and what was read of it; a node may appear twice). ``valid`` from
    :meth:`arm` until :func:`notify` releases it; never valid if not armed. ``on_release``, if set,
    is called once, when it is released (its owner's results that rest on it are stale)."""

    __slots__ = ("nodes", "on_release", "reads", "run", "valid")

    def __init__(self, run: Sequence[Watched], reads: Sequence[tuple[Watched, int]]) -> None:
        self.run, self.reads = run, reads
        self.valid = False
        self.nodes: list[Watched] = []  # where it is registered
        self.on_release: Callable[[], None] | None = None

    def arm(self) -> None:
        """Registers on every node read, for what was read. Call it before the tree changes after
        the walk: a change in between would go unnoticed."""
        if self.valid or self.nodes:
            raise RuntimeError("a watch is armed once")
        for node in self.run:  # distinct nodes, none read before by this watch
            if (w := node.watch) is None:
                node.watch = {self: RESIDENCY}
            else:
                w[self] = RESIDENCY
        nodes = self.nodes
        nodes += self.run
        for node, what in self.reads:
            if (w := node.watch) is None:
                node.watch = {self: what}
                nodes.append(node)
            elif (had := w.get(self)) is None:
                w[self] = what
                nodes.append(node)
            else:
                w[self] = had | what
        self.run = self.reads = ()
        self.valid = True

    def release(self) -> None:
        """Invalid from now on; unregistered from every node it read; ``on_release`` called."""
        self.valid = False
        if (on_release := self.on_release) is not None:
            self.on_release = None
            on_release()
        for node in self.nodes:
            if (w := node.watch) is not None:
                w.pop(self, None)
                if not w:
                    node.watch = None  # most nodes are watched by nobody: no empty dict on each
        self.nodes = []
        self.run = self.reads = ()


def notify(node: Watched, changed: int) -> None:
    """``changed`` (bits) of ``node`` changed: releases every watch that read any of them. The tree
    calls it only where ``node.watch`` is non-empty."""
    w = node.watch
    if w is None:
        return
    for watch, what in list(w.items()):  # release() edits the dict
        if what & changed:
            watch.release()
