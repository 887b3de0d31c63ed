"""The HiRadixTree: a prefix tree over block keys recording, per block, which KV tiers hold it.

One node per cache block; a prompt is a tuple of block keys from the root, and equal leading keys
mean an equal prefix (so equal KV). Each node records its residency per :class:`Tier`, a lock count
(requests using the block), *transient* marks, and its last access time. The simulator's engine
model and the CPU reference engine use it to find how much of a prompt each tier can serve, to
choose LRU victims per tier, and to detect delay hits.

Inspiration: Strata (§4, the HiRadixTree that extends SGLang's RadixTree into a page table for every
tier of the hierarchy, and §4.3.1, *transient nodes* marked in-queue / in-flight so that a request
whose missing context is already queued or being computed is deferred instead of recomputing it)
and SGLang HiCache (``HiRadixCache``: per-node device/host residency, lock refs protecting a
request's path, leaf-first LRU eviction per tier).

Invariants (checked by :meth:`HiRadixTree.check_integrity`):

- ``used_blocks(t)`` equals the number of nodes resident in ``t`` and never exceeds its capacity.
- Lock and mark counts are ``>= 0``. A lock is a *hold* on a path from the root (a request's
  device prefix); a node's lock count is the number of holds through it, i.e. the holds ending
  there plus its children's counts (``lock >= child_locks``, checked in O(1) by every lock and
  unlock). So a locked block's ancestors are locked too.
- A node with no residency, no lock, no mark and no children does not exist (it is pruned at once),
  so memory is bounded by the blocks the tiers hold plus the paths locked or marked.
- ``_lru[t]`` holds exactly the nodes resident in ``t`` with lock count 0, least recently used
  first, and every node comes *after* all of its descendants in the same list. Touches move a whole
  path to the end deepest-first; a node enters a list only through a touch, an unlock (which also
  moves the path deepest-first) or a demotion (which moves the node's ancestors after it). So the head is always an LRU *leaf
  for t* (no child resident in ``t``): eviction pops it in O(1), and evicting leaf-first keeps each
  tier's residency a prefix-closed set (a block is held only if its parent is), as long as callers
  insert whole paths and do not cut holes with :meth:`HiRadixTree.remove_residency`.
- Recency is the order of touches (``now_s`` may not decrease: :class:`SimError`). An unlock that
  frees a block counts as a use (the request just finished with it; SGLang re-inserts a finished
  request's path), and a block demoted to a lower tier is that tier's most recently used.

A node also carries the :mod:`kvtier.radix.watch` watches registered on it (what lookups read of
it): a change of its fastest tier or marks, a new child and pruning release those that read it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Final

from kvtier.errors import ConfigError, IntegrityError, SimError
from kvtier.radix.integrity import check_node
from kvtier.radix.match import Match
from kvtier.radix.watch import CHILD, MARKS, PRUNED, RESIDENCY, Watch, notify
from kvtier.tiers import Tier

# Read per node: a constant (radix sits below kvtier.sched.members, which says why).
_DEVICE: Final = Tier.DEVICE

_NUM_TIERS = len(Tier)
_ALL_TIERS = tuple(Tier)
# Residency is a bit mask (bit t set: resident in tier t); these tables decode it without loops.
_TIERS_OF_MASK: tuple[tuple[int, ...], ...] = tuple(
    tuple(t for t in range(_NUM_TIERS) if mask >> t & 1) for mask in range(1 << _NUM_TIERS)
)
_FASTEST_OF_MASK: tuple[Tier | None, ...] = tuple(
    Tier((mask & -mask).bit_length() - 1) if mask else None for mask in range(1 << _NUM_TIERS)
)


class _Node:
    __slots__ = (
        "child_locks",
        "children",
        "in_flight",
        "in_queue",
        "key",
        "last_access_s",
        "lock",
        "parent",
        "residency",
        "watch",
    )

    def __init__(self, key: int, parent: _Node | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.residency = 0  # bit mask over Tier values
        self.lock = 0  # holds through this node
        self.child_locks = 0  # sum of the children's lock counts
        self.in_queue = 0
        self.in_flight = 0
        self.last_access_s = 0.0
        self.watch: dict[Watch, int] | None = None  # kvtier.radix.watch: what walks read here

    def prunable(self) -> bool:
        return not (self.residency or self.children or self.lock or self.in_queue or self.in_flight)


class HiRadixTree:
    """Block-key prefix tree with per-tier residency, LRU eviction, locks and transient marks.

    ``capacity_blocks`` gives each tier's capacity in blocks (``None``: unbounded); a tier left out
    has capacity 0. Every call costs O(path length), plus O(1) per block evicted or pruned.

    ``keys`` is always a path from the root (a prompt's block keys, or a prefix of them); calls with
    ``start`` act on the blocks ``keys[start:]`` of that path only.
    """

    def __init__(self, capacity_blocks: Mapping[Tier, int | None]) -> None:
        for tier, cap in capacity_blocks.items():
            if not isinstance(tier, Tier):
                raise ConfigError(f"capacity_blocks key {tier!r} is not a Tier; expected one of {list(Tier)}")
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
                raise ConfigError(f"capacity_blocks[{tier.label}] is {cap!r}; expected an int >= 0 or None")
        self._capacity: list[int | None] = [capacity_blocks.get(t, 0) for t in _ALL_TIERS]
        self._used = [0] * _NUM_TIERS
        self._lru: list[OrderedDict[_Node, None]] = [OrderedDict() for _ in _ALL_TIERS]
        self._root = _Node(-1, None)
        self._num_nodes = 0  # not counting the root
        self._now_s = float("-inf")  # latest touch time; touches must not go back in time

    # ----- queries -----

    @property
    def num_nodes(self) -> int:
        """Blocks the tree knows about (resident, locked, marked, or an ancestor of one)."""
        return self._num_nodes

    def capacity_blocks(self, tier: Tier) -> int | None:
        return self._capacity[tier]

    def used_blocks(self, tier: Tier) -> int:
        return self._used[tier]

    def free_blocks(self, tier: Tier) -> int | None:
        cap = self._capacity[tier]
        return None if cap is None else cap - self._used[tier]

    def evictable_blocks(self, tier: Tier) -> int:
        """Blocks resident in ``tier`` and not locked: what eviction could free."""
        return len(self._lru[tier])

    def can_insert(self, n_blocks: int, tier: Tier) -> bool:
        """Whether ``n_blocks`` new blocks fit in ``tier`` after evicting every unlocked block."""
        cap = self._capacity[tier]
        return cap is None or cap - self._used[tier] + len(self._lru[tier]) >= n_blocks

    def match(self, keys: Sequence[int], now_s: float | None = None, own_queue_marks: int = 0) -> Match:
        """Find what the tiers hold of ``keys``; with ``now_s``, the matched blocks count as used.

        ``own_queue_marks``: in-queue marks the caller itself holds on these keys (a waiting request
        marks its own blocks); only marks beyond them count as another request's delay hit.
        """
        # One walk, ending with the resident run and the marked run after the device prefix.
        tiers: list[Tier] = []
        path: list[_Node] = []  # the resident run
        in_queue = in_flight = transient = 0
        resident = marked = device_run = True
        node = self._root
        for key in keys:
            if (child := node.children.get(key)) is None or not (resident or marked):
                break
            node = child
            fastest = _FASTEST_OF_MASK[node.residency] if resident else None
            if fastest is not None:
                tiers.append(fastest)
                path.append(node)
                if device_run and fastest is _DEVICE:
                    continue  # the transient run starts after the device prefix
            resident = resident and fastest is not None
            device_run = False
            if marked and (marked := bool((queued := node.in_queue > own_queue_marks) or node.in_flight)):
                transient += 1
                in_queue += queued
                in_flight += node.in_flight > 0
        if now_s is not None:
            self._advance_clock(now_s)
            self._touch(path, now_s)
        return Match(len(tiers), tuple(tiers), in_queue, in_flight, transient)

    # ----- residency -----

    def insert(self, keys: Sequence[int], tier: Tier, now_s: float, start: int = 0) -> list[tuple[int, Tier]]:
        """Make blocks ``keys[start:]`` resident in ``tier`` (creating nodes) and touch the whole path.

        Evicts LRU unlocked blocks of ``tier`` (never blocks of this path) to make room and returns
        them as ``(key, tier)`` so the caller can offload them. Raises :class:`SimError`, changing
        nothing, if the tier cannot make room because too much of it is locked.
        """
        _check_start(keys, start)
        self._advance_clock(now_s)
        t = int(tier)
        bit = 1 << t
        path = self._walk(keys)
        need = len(keys) - start - sum([1 for node in path[start:] if node.residency & bit])
        evicted: list[tuple[int, Tier]] = []
        cap = self._capacity[t]
        if cap is not None and self._used[t] + need > cap:
            deficit = self._used[t] + need - cap
            protected = sum(1 for node in path if node.residency & bit and not node.lock)
            evictable = len(self._lru[t]) - protected
            if evictable < deficit:
                raise SimError(
                    f"tier {tier.label} cannot hold {need} more blocks: {cap - self._used[t]} free, "
                    f"{evictable} evictable, the rest locked or on this path (capacity {cap})"
                )
            # Touched nodes go to the MRU end, so popping `deficit` from the head spares the path.
            self._touch(path, now_s)
            evicted = [(key, tier) for key in self._evict(t, deficit)]
            path = self._walk(keys)  # evictions may have pruned unresident nodes of the path
        node = path[-1] if path else self._root
        for key in keys[len(path) :] if start < len(keys) else ():
            node = self._new_child(node, key)
            path.append(node)
        lru = self._lru[t]
        for node in path[start:]:
            if not node.residency & bit:
                node.residency |= bit
                if node.watch and not node.residency & (bit - 1):  # its fastest tier changed
                    notify(node, RESIDENCY)
                self._used[t] += 1
                if not node.lock:
                    lru[node] = None  # placed by the touch below
        self._touch(path, now_s)
        return evicted

    def evict(self, tier: Tier, n_blocks: int, demote_to: Tier | None = None) -> list[int]:
        """Evict up to ``n_blocks`` unlocked blocks from ``tier``, LRU leaf first; returns their keys.

        A block leaves ``tier`` only once none of its children is resident there; other tiers keep
        their copies. With ``demote_to``, each victim also becomes resident there (as most recently
        used) while that tier has free room (make room first: victims that do not fit are dropped);
        this costs O(depth) per victim. Nodes left with nothing are pruned.
        """
        if n_blocks < 0:
            raise SimError(f"evict: n_blocks is {n_blocks}; expected >= 0")
        if demote_to is not None and demote_to == tier:
            raise SimError(f"evict: cannot demote {tier.label} blocks to {demote_to.label}")
        return self._evict(int(tier), n_blocks, None if demote_to is None else int(demote_to))

    def remove_residency(self, keys: Sequence[int], tier: Tier, start: int = 0) -> list[int]:
        """Drop ``tier``'s copy of blocks ``keys[start:]`` (e.g. a lost remote object, a failed load).

        Blocks not in the tree or not in ``tier`` are skipped; returns the keys dropped. Raises
        :class:`SimError`, changing nothing, for a locked block's device copy (a request is using it).
        Dropping a block whose descendants stay in ``tier`` leaves a hole in that tier's prefix.
        """
        _check_start(keys, start)
        t = int(tier)
        bit = 1 << t
        path = self._walk(keys)
        targets = [node for node in path[start:] if node.residency & bit]
        if t == _DEVICE and any(node.lock for node in targets):
            raise SimError("remove_residency: a block's device copy is locked by a request")
        for node in reversed(targets):
            node.residency &= ~bit
            if node.watch and not node.residency & (bit - 1):
                notify(node, RESIDENCY)
            self._used[t] -= 1
            self._lru[t].pop(node, None)
        if path:
            self._prune_upwards(path[-1])
        return [node.key for node in targets]

    # ----- locks and transient marks -----

    def lock(self, keys: Sequence[int], start: int = 0) -> None:
        """Add a hold on the path ``keys`` (creating nodes): no tier may evict its blocks.

        With ``start > 0``, extend the caller's hold on ``keys[:start]`` to ``keys`` (a request
        locking blocks as they land); AssertionError if no hold ends at ``keys[:start]``.
        """
        _check_start(keys, start)
        if start == len(keys):
            return
        node = self._root
        if start:
            node = self._existing_path(keys[:start], "lock")[-1]
            if node.lock <= node.child_locks:
                raise AssertionError(f"lock: no hold ends at the first {start} keys, nothing to extend")
        lrus = self._lru
        for key in keys[start:]:
            child = node.children.get(key) or self._new_child(node, key)
            node.child_locks += 1
            node = child
            node.lock += 1
            if node.lock == 1:
                for t in _TIERS_OF_MASK[node.residency]:
                    del lrus[t][node]

    def unlock(self, keys: Sequence[int], start: int = 0) -> None:
        """Drop a hold on the path ``keys``; with ``start > 0``, shorten it to ``keys[:start]``.

        AssertionError, changing nothing, if no hold ends at ``keys`` (an unlock below zero, or of a
        path other than the one locked). Blocks left unlocked count as just used.
        """
        _check_start(keys, start)
        path = self._existing_path(keys, "unlock")
        if start == len(path):
            return
        deepest = path[-1]
        if deepest.lock <= deepest.child_locks:
            raise AssertionError(f"unlock below zero: no hold ends at this path of {len(keys)} keys")
        lrus = self._lru
        parent = path[start - 1] if start else self._root
        for node in path[start:]:
            parent.child_locks -= 1
            parent = node
        for node in reversed(path[start:]):
            node.lock -= 1
            if not node.lock:
                for t in _TIERS_OF_MASK[node.residency]:
                    lrus[t][node] = None
        self._prune_upwards(deepest)

    def mark_in_queue(self, keys: Sequence[int], on: bool, start: int = 0) -> None:
        """Blocks ``keys[start:]`` will be brought to device by a waiting request (Strata's in-queue
        transient mark). Marks count; releasing one below zero raises AssertionError."""
        self._mark(keys, on, "in_queue", start)

    def mark_in_flight(self, keys: Sequence[int], on: bool, start: int = 0) -> None:
        """Blocks ``keys[start:]`` are being loaded or computed onto device (Strata's in-flight mark)."""
        self._mark(keys, on, "in_flight", start)

    # ----- checks -----

    def check_integrity(self) -> None:
        """Raise :class:`IntegrityError` if an invariant in the module docstring does not hold."""
        counts = [0] * _NUM_TIERS
        listed = [0] * _NUM_TIERS
        num_nodes = 0
        position = [{node: i for i, node in enumerate(lru)} for lru in self._lru]
        # Stack entries: node, and per tier the LRU position of its nearest ancestor in that list.
        stack: list[tuple[_Node, tuple[int | None, ...]]] = [(self._root, (None,) * _NUM_TIERS)]
        while stack:
            node, ancestor_pos = stack.pop()
            if node is not self._root:
                num_nodes += 1
                check_node(node, position, ancestor_pos, counts, listed)
                ancestor_pos = tuple(position[t].get(node, ancestor_pos[t]) for t in range(_NUM_TIERS))
            for key, child in node.children.items():
                if child.key != key or child.parent is not node:
                    raise IntegrityError(f"node {key} is linked to the wrong parent or under the wrong key")
                stack.append((child, ancestor_pos))
        if num_nodes != self._num_nodes:
            raise IntegrityError(f"{num_nodes} nodes reachable; counter says {self._num_nodes}")
        if self._root.child_locks != sum(child.lock for child in self._root.children.values()):
            raise IntegrityError("the root's child_locks disagrees with its children's lock counts")
        for t in _ALL_TIERS:
            cap = self._capacity[t]
            if counts[t] != self._used[t]:
                raise IntegrityError(f"{t.label}: {counts[t]} resident, used_blocks says {self._used[t]}")
            if cap is not None and counts[t] > cap:
                raise IntegrityError(f"{t.label}: {counts[t]} blocks exceed capacity {cap}")
            if listed[t] != len(self._lru[t]):
                raise IntegrityError(f"{t.label}: LRU holds {len(self._lru[t]) - listed[t]} detached nodes")

    def iter_residency(self) -> Iterator[tuple[tuple[int, ...], Tier]]:
        """Every (path, tier) residency, depth first; for tests and debugging, O(tree)."""
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self._root, ())]
        while stack:
            node, prefix = stack.pop()
            for key, child in node.children.items():
                path = (*prefix, key)
                for t in _TIERS_OF_MASK[child.residency]:
                    yield path, _ALL_TIERS[t]
                stack.append((child, path))

    # ----- internals -----

    def _walk(self, keys: Sequence[int]) -> list[_Node]:
        """The existing nodes along ``keys``, stopping at the first key not in the tree."""
        path: list[_Node] = []
        visit, children = path.append, self._root.children
        try:  # a missing key ends it: rarer than a found one, so no test per key
            for key in keys:
                visit(node := children[key])
                children = node.children
        except KeyError:
            pass
        return path

    def _existing_path(self, keys: Sequence[int], what: str) -> list[_Node]:
        path = self._walk(keys)
        if len(path) != len(keys):
            raise AssertionError(f"{what}: key {keys[len(path)]} at position {len(path)} is not in the tree")
        return path

    def _new_child(self, parent: _Node, key: int) -> _Node:
        child = _Node(key, parent)
        parent.children[key] = child
        if parent.watch:
            notify(parent, CHILD)
        self._num_nodes += 1
        return child

    def _advance_clock(self, now_s: float) -> None:
        if now_s < self._now_s:
            raise SimError(f"time went backwards: now_s {now_s} < {self._now_s}; LRU order is touch order")
        self._now_s = now_s

    def _touch(self, path: Sequence[_Node], now_s: float) -> None:
        """Mark ``path`` (root first) used at ``now_s``: move it to each LRU's end, deepest first."""
        lrus = self._lru
        for node in reversed(path):
            node.last_access_s = now_s
            if not node.lock:
                for t in _TIERS_OF_MASK[node.residency]:
                    lrus[t].move_to_end(node)

    def _evict(self, t: int, n_blocks: int, demote_to: int | None = None) -> list[int]:
        lru, used = self._lru[t], self._used
        mask, faster = ~(1 << t), (1 << t) - 1  # faster: the tiers above t
        evicted: list[int] = []
        pop, victim = lru.popitem, evicted.append
        for _ in range(min(n_blocks, len(lru))):  # only this loop takes from t's list
            node = pop(last=False)[0]
            node.residency &= mask
            if node.watch and not node.residency & faster:
                notify(node, RESIDENCY)
            used[t] -= 1
            victim(node.key)
            if demote_to is not None:
                self._demote(node, demote_to)
            self._prune_upwards(node)  # it and its ancestors holding nothing go
        return evicted

    def _demote(self, node: _Node, d: int) -> None:
        """Make an evicted (so unlocked) ``node`` resident in tier ``d``, as MRU, if ``d`` has room."""
        bit = 1 << d
        if not node.residency & bit:
            cap = self._capacity[d]
            if cap is not None and self._used[d] >= cap:
                return
            node.residency |= bit
            if node.watch and not node.residency & (bit - 1):
                notify(node, RESIDENCY)
            self._used[d] += 1
        lru = self._lru[d]
        lru[node] = None
        lru.move_to_end(node)
        # Its ancestors in d must stay after it (leaf-first). Holes in d rule out stopping early;
        # a locked ancestor means all above it are locked, so none of them is in the list.
        ancestor = node.parent
        while ancestor is not None and not ancestor.lock:
            if ancestor in lru:
                lru.move_to_end(ancestor)
            ancestor = ancestor.parent

    def _prune_upwards(self, node: _Node) -> None:
        """Remove ``node`` and then its ancestors while they hold nothing."""
        while (parent := node.parent) is not None and not (
            node.residency or node.children or node.lock or node.in_queue or node.in_flight
        ):  # not node.prunable(), inline
            del parent.children[node.key]
            node.parent = None
            if node.watch:
                notify(node, PRUNED)
            self._num_nodes -= 1
            node = parent

    def _mark(self, keys: Sequence[int], on: bool, field: str, start: int) -> None:
        _check_start(keys, start)
        if start == len(keys):
            return
        queue = field == "in_queue"  # else in_flight; each spelled out (a mark per request per step)
        if on:
            node, new_child = self._root, self._new_child
            for key in keys[:start]:
                node = node.children.get(key) or new_child(node, key)
            for key in keys[start:]:
                node = node.children.get(key) or new_child(node, key)
                if queue:
                    node.in_queue += 1
                else:
                    node.in_flight += 1
                if node.watch:
                    notify(node, MARKS)
            return
        path = self._existing_path(keys, f"unmark {field}")[start:]
        if min([node.in_queue if queue else node.in_flight for node in path], default=1) <= 0:
            raise AssertionError(f"unmark {field} below zero on path of {len(keys)} keys")
        for node in path:
            if queue:
                node.in_queue -= 1
            else:
                node.in_flight -= 1
            if node.watch:
                notify(node, MARKS)
        if path:
            self._prune_upwards(path[-1])


def _check_start(keys: Sequence[int], start: int) -> None:
    if not 0 <= start <= len(keys):
        raise SimError(f"start is {start}; expected 0..{len(keys)} for a path of {len(keys)} keys")
