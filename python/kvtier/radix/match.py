"""What the prefix tree holds of a prompt: :class:`Match`, the result of
:meth:`kvtier.radix.HiRadixTree.match`."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.tiers import Tier


@dataclass(frozen=True, slots=True)
class Match:
    """What the tree holds of a prompt's blocks (a miss is ``keys_matched == 0``).

    ``tiers[i]`` is the fastest tier holding block ``i``. The transient counts look at the run of
    blocks right after the device prefix that carry a mark: ``transient_blocks`` is its length, and
    ``in_queue_blocks`` / ``in_flight_blocks`` count the blocks of that run marked in-queue /
    in-flight (a block with both marks counts in both). A request with such a run would recompute or
    reload KV that another request is about to bring to device: a delay hit (Strata §4.3.1).
    """

    keys_matched: int
    tiers: tuple[Tier, ...]
    in_queue_blocks: int = 0
    in_flight_blocks: int = 0
    transient_blocks: int = 0

    def prefix_in(self, tier: Tier) -> int:
        """Length of the longest prefix whose blocks are all held in ``tier`` or a faster tier."""
        n = 0
        for t in self.tiers:
            if t > tier:
                break
            n += 1
        return n
