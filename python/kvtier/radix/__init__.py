"""The prefix index: :class:`HiRadixTree`, a block-key prefix tree with per-tier residency, lock
counts and transient (in-queue / in-flight) marks for delay-hit detection."""

from kvtier.radix.match import Match
from kvtier.radix.tree import HiRadixTree

__all__ = ["HiRadixTree", "Match"]
