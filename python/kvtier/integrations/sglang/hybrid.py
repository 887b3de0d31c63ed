"""Which prefixes of a hit query a hybrid model's host pools can restore (SGLang's v2 hit query,
``batch_exists_v2``; docs/sglang.md "Hybrid models"). No SGLang, torch or store import here.

SGLang asks with the KV pages' hash strings (a chain over the prompt) and one ``PoolTransfer`` per
extra pool, each with a hit policy (``hicache_storage.py`` ``PoolHitPolicy``):

- ``all_pages``: the pool has a page for every KV page of the prefix (a KV-derived pool: draft KV,
  a sparse indexer). A prefix of ``n`` pages is restorable when pages ``0..n`` are all stored.
- ``trailing_pages``: the pool holds only a window ending at the prefix's last page (SWA KV: the
  window's pages; Mamba: one page, the state snapshot taken there). A prefix of ``n`` pages is
  restorable when the ``w`` pages ending at page ``n - 1`` are stored (``w`` = the transfer's
  key count, at least 1). So 5 can be restorable while 4 and 3 are not.

The answer is every restorable prefix length (SGLang intersects these sets over TP ranks, then
takes the largest), the largest one, and each pool's own largest. A length is reported only when
every pool holds what it needs, exactly as SGLang's file and Mooncake backends decide.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from kvtier.errors import LayoutError

ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"
KV = "kv"


@dataclass(frozen=True)
class PoolPresence:
    """One pool of a hit query: its name, SGLang's hit policy, the window of a trailing pool, and
    whether its page under each of the first KV pages' keys is stored (one entry per KV page)."""

    name: str
    policy: str
    window_pages: int
    present: tuple[bool, ...]


@dataclass(frozen=True)
class HitVerdict:
    """``restorable``: every prefix length (in pages) that KV and every pool can restore, ascending;
    ``pool_hit_pages``: each pool's own longest (``"kv"`` for the KV pages), absent when 0."""

    restorable: tuple[int, ...]
    pool_hit_pages: dict[str, int]

    @property
    def hit_pages(self) -> int:
        return self.restorable[-1] if self.restorable else 0


def hit_verdict(kv_pages: int, pools: list[PoolPresence]) -> HitVerdict:
    """The prefixes of ``kv_pages`` consecutive stored KV pages that every pool can restore.
    LayoutError for a hit policy other than ``all_pages`` and ``trailing_pages``."""
    hits = {KV: kv_pages} if kv_pages else {}
    restorable = set(range(1, kv_pages + 1))
    for pool in pools:
        present = pool.present[:kv_pages]
        if len(present) != kv_pages:
            raise LayoutError(f"pool {pool.name!r}: {len(present)} presence flags for {kv_pages} KV pages")
        if pool.policy == ALL_PAGES:
            boundary = present.index(False) if False in present else kv_pages
            ok = set(range(1, boundary + 1))
        elif pool.policy == TRAILING_PAGES:
            if pool.window_pages < 1:
                raise LayoutError(f"pool {pool.name!r}: a trailing window of {pool.window_pages} pages")
            stored = [0, *accumulate(int(p) for p in present)]  # stored[n]: pages 0..n stored
            ok = {
                n
                for n in range(1, kv_pages + 1)
                if stored[n] - stored[max(0, n - pool.window_pages)] == min(n, pool.window_pages)
            }
            boundary = max(ok, default=0)
        else:
            raise LayoutError(
                f"pool {pool.name!r} asks with hit policy {pool.policy!r}; kvtier answers "
                f"{ALL_PAGES!r} and {TRAILING_PAGES!r}"
            )
        if boundary:
            hits[pool.name] = boundary
        restorable &= ok
    return HitVerdict(tuple(sorted(restorable)), hits)
