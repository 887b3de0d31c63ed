"""The KV tiers, one vocabulary for the whole package (issue 18 step 5).

:class:`Tier` is the only spelling of a tier in code: the prefix tree's residency, the scheduler's
per-tier token counts (:class:`PerTier`: ``RequestView.cached_tokens``, a request's hit tokens), load targets,
the simulator's links and metrics, and the reference engine's loads all use it. Strings appear only
where a user reads or writes them, and are mapped here, in one place:

- :attr:`Tier.label` / :meth:`Tier.parse`: ``"device"``, ``"host"``, ``"ssd"``, ``"remote"`` (config
  keys such as ``preload_tier``, report and JSON keys such as ``hit_rate_tokens``).
- :meth:`Tier.from_store`: the store's tier names (``Store.lookup(...).tiers``, ``tier_stats()``),
  where host memory is ``"dram"``.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

from kvtier.errors import ConfigError


class Tier(IntEnum):
    """Where a block's KV may live, fastest first (a lower value is a faster tier).

    An ``IntEnum`` so that a :class:`PerTier` (``cached_tokens``, ``hit_tokens``) is indexed by tier.
    """

    DEVICE = 0
    HOST = 1
    SSD = 2
    REMOTE = 3

    @property
    def label(self) -> str:
        """The lower-case name used in configs and reports: ``"device"``, ``"host"``, ..."""
        return self.name.lower()

    @classmethod
    def parse(cls, label: str) -> Tier:
        """The tier named ``label`` (:attr:`label`); :class:`ConfigError` for any other name."""
        try:
            return cls[label.upper()]
        except KeyError:
            known = ", ".join(t.label for t in cls)
            raise ConfigError(f"unknown tier {label!r}; known tiers: {known}") from None

    @classmethod
    def from_store(cls, name: str) -> Tier:
        """The tier of a store tier name (``"dram"``, ``"ssd"``, ``"remote"``, as the store reports)."""
        tier = _STORE_NAMES.get(name)
        if tier is None:
            raise ConfigError(f"unknown store tier {name!r}; known: {', '.join(_STORE_NAMES)}")
        return tier


class PerTier(NamedTuple):
    """One count per tier, fastest first: ``counts.host`` or ``counts[Tier.HOST]`` (the fields are the
    tiers' labels, in :class:`Tier` order). A tuple, so that it slices (``counts[Tier.HOST:]``: the
    tiers below the device), sums, and compares and serializes like the plain 4-tuple it replaces."""

    device: int = 0
    host: int = 0
    ssd: int = 0
    remote: int = 0


#: No tokens in any tier (an admitted request's view: its cached prefix is already computed).
NO_TOKENS = PerTier()

#: The store's names for its tiers (``kvtier._core.STORE_TIERS``, from Rust's ``TierKind``; host
#: memory is ``"dram"`` there): the one place they are mapped (tests/test_tiers.py checks it).
_STORE_NAMES = {"dram": Tier.HOST, "ssd": Tier.SSD, "remote": Tier.REMOTE}
