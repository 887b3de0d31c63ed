"""The simulated engine's tiers below the device: capacity, eviction and writes down
(:class:`LowerTiers`, one seam of :mod:`kvtier.sim.engine`).

Host, SSD and remote, in that order, each with its capacity in blocks and the link that reaches it
from host memory; a tier of capacity 0 is absent. Capacity is managed here, not in the prefix index
(:class:`HiRadixTree`): before a block is placed on a tier, room is made by evicting that tier's
least-recently-used unlocked blocks. Under ``write_back`` they are written down to the next tier
(their KV lives on below); otherwise the tiers below already hold copies, so they are dropped.
Host blocks holding swapped-out requests' KV (``swap_host_blocks``) are outside the index and
shrink the host tier.
"""

from __future__ import annotations

from typing import Protocol

from kvtier.radix import HiRadixTree
from kvtier.sched.members import DEVICE, HOST
from kvtier.sim.core import EventLoop
from kvtier.sim.resources import Direction, Link, StripedLink, Transfer
from kvtier.tiers import Tier


class TierOwner(Protocol):
    """What the tiers read of the engine that owns them (its policy may be replaced between runs)."""

    @property
    def offload(self) -> str: ...
    @property
    def tree(self) -> HiRadixTree: ...
    @property
    def loop(self) -> EventLoop: ...


class LowerTiers:
    def __init__(
        self,
        owner: TierOwner,
        tiers: dict[Tier, tuple[int, Link | StripedLink]],
        block_bytes: int,
        offload_priority: int,
    ) -> None:
        self._owner = owner
        self._tiers = {tier: entry for tier, entry in tiers.items() if entry[0]}
        self.block_bytes = block_bytes
        self.offload_priority = offload_priority  # link class of writes down: below loads (1)
        self.swap_host_blocks = 0  # host blocks holding swapped-out requests' KV

    def __contains__(self, tier: Tier) -> bool:
        return tier in self._tiers

    def tiers(self) -> tuple[Tier, ...]:
        return tuple(self._tiers)

    def link(self, tier: Tier) -> Link | StripedLink:
        """The link that reaches ``tier`` from host memory."""
        return self._tiers[tier][1]

    def capacity(self, tier: Tier) -> int:
        capacity = self._tiers[tier][0]
        return capacity - self.swap_host_blocks if tier is HOST else capacity

    def free_blocks(self, tier: Tier) -> int:
        return self.capacity(tier) - self._owner.tree.used_blocks(tier)

    def swap_room(self) -> int:
        """Host blocks a swap-out can take now: free ones plus unlocked cached ones, which
        :meth:`make_room` evicts for it (the engine's swap space, shown to policies as
        ``SchedulerView.free_host_blocks``; 0 without a host tier)."""
        if HOST not in self._tiers:
            return 0
        return self.free_blocks(HOST) + self._owner.tree.evictable_blocks(HOST)

    def _next_lower(self, tier: Tier) -> Tier | None:
        return next((t for t in self._tiers if t > tier), None)

    def make_room(self, tier: Tier, blocks: int) -> None:
        """Frees ``blocks`` in ``tier``: its LRU unlocked blocks are written down (write-back) or
        dropped."""
        short = blocks - self.free_blocks(tier)
        if short <= 0:
            return
        tree = self._owner.tree
        lower = self._next_lower(tier) if self._owner.offload == "write_back" else None
        if lower is None:
            tree.evict(tier, short)
            return
        self.make_room(lower, short)
        demoted = tree.evict(tier, short, demote_to=lower)
        self._offload_bytes(lower, len(demoted))

    def evict_device(self, blocks: int) -> None:
        """Evicts ``blocks`` unlocked device blocks; under write-back they are copied down to host."""
        tree = self._owner.tree
        if self._owner.offload == "write_back" and HOST in self:
            self.make_room(HOST, blocks)
            demoted = tree.evict(DEVICE, blocks, demote_to=HOST)
            self._offload_bytes(HOST, len(demoted))
        else:
            tree.evict(DEVICE, blocks)

    def _offload_bytes(self, tier: Tier, blocks: int) -> None:
        """Charges the write of ``blocks`` into ``tier`` to the link that reaches it."""
        if blocks:
            nbytes = blocks * self.block_bytes
            self.link(tier).submit(nbytes, Direction.OUT, _ignore, self.block_bytes, self.offload_priority)

    def place(self, path: tuple[int, ...], tier: Tier) -> None:
        """Makes the longest prefix of ``path`` that the tier can hold resident there."""
        keep = min(len(path), self.capacity(tier))
        if keep <= 0:
            return
        self.make_room(tier, keep)
        if self.free_blocks(tier) >= keep:  # else all of it is locked
            self._owner.tree.insert(path[:keep], tier, self._owner.loop.now_s)

    def write_through(self, path: tuple[int, ...], new_blocks: int) -> None:
        """Copies the ``new_blocks`` last blocks of ``path`` to every lower tier (LMCache stores to
        all its backends; HiCache backs up to host and storage); each tier holds them once landed."""
        nbytes = new_blocks * self.block_bytes
        for tier, (_, link) in self._tiers.items():

            def stored(_t: Transfer, tier: Tier = tier) -> None:
                self.place(path, tier)

            link.submit(nbytes, Direction.OUT, stored, self.block_bytes, self.offload_priority)


def _ignore(_t: Transfer) -> None:
    return None
