"""Tests of kvtier.radix: prefix sharing, per-tier residency, LRU leaf-first eviction, locks,
transient marks, pruning, and a random op sequence checked against a naive model."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.errors import ConfigError, SimError
from kvtier.radix import HiRadixTree, Match
from kvtier.tiers import Tier

D, H, S, R = Tier.DEVICE, Tier.HOST, Tier.SSD, Tier.REMOTE


def tree(
    device: int | None = 8, host: int | None = 16, ssd: int | None = None, remote: int | None = 0
) -> HiRadixTree:
    return HiRadixTree({D: device, H: host, S: ssd, R: remote})


# ----- tiers and construction -----


def test_tier_order_and_labels() -> None:
    assert list(Tier) == [D, H, S, R]
    assert D < H < S < R
    assert [t.label for t in Tier] == ["device", "host", "ssd", "remote"]
    assert Tier.parse("ssd") is S
    with pytest.raises(ConfigError, match="known tiers: device, host, ssd, remote"):
        Tier.parse("tape")


@pytest.mark.parametrize("capacity", [-1, 1.5, True, "8"])
def test_bad_capacity_is_rejected(capacity: object) -> None:
    with pytest.raises(ConfigError):
        HiRadixTree({D: capacity})  # type: ignore[dict-item]


def test_missing_tier_has_no_capacity() -> None:
    t = HiRadixTree({D: None})
    assert t.free_blocks(D) is None
    assert t.free_blocks(H) == 0
    with pytest.raises(SimError):
        t.insert([1], H, 0.0)


# ----- prefix sharing and matching -----


def test_prefix_sharing() -> None:
    t = tree()
    assert t.insert([1, 2, 3], D, 0.0) == []
    assert t.insert([1, 2, 4], D, 1.0) == []
    assert t.num_nodes == 4 and t.used_blocks(D) == 4 and t.free_blocks(D) == 4
    assert t.match([1, 2, 5, 6]).keys_matched == 2
    assert t.match([1, 2, 4]) == Match(3, (D, D, D))
    assert t.match([9, 2, 3]) == Match(0, ())
    # The same key under another parent is another block.
    t.insert([9, 2, 3], D, 2.0)
    assert t.num_nodes == 7
    assert t.match([9, 2, 3]).keys_matched == 3
    t.check_integrity()


def test_prefix_in_per_tier() -> None:
    t = tree()
    t.insert([1, 2, 3, 4], S, 0.0)
    t.insert([1, 2, 3], H, 1.0)
    t.insert([1, 2], D, 2.0)
    m = t.match([1, 2, 3, 4, 5])
    assert m.keys_matched == 4
    assert m.tiers == (D, D, H, S)
    assert [m.prefix_in(tier) for tier in Tier] == [2, 3, 4, 4]
    # A device block after a slower one does not extend the device prefix.
    assert Match(3, (H, D, D)).prefix_in(D) == 0


def test_time_must_not_go_backwards() -> None:
    t = tree()
    t.insert([1], D, 5.0)
    with pytest.raises(SimError, match="time"):
        t.insert([2], D, 4.0)
    with pytest.raises(SimError, match="time"):
        t.match([1], now_s=4.0)
    t.match([1], now_s=5.0)
    t.check_integrity()


def test_match_without_now_does_not_touch() -> None:
    t = tree()
    t.insert([1], D, 0.0)
    t.insert([2], D, 1.0)
    t.match([1])
    assert t.evict(D, 1) == [1]
    t.insert([1], D, 2.0)
    t.match([2], now_s=3.0)
    assert t.evict(D, 1) == [1]


# ----- eviction -----


def test_eviction_is_lru_and_leaf_first() -> None:
    t = tree()
    t.insert([5], D, 0.0)
    t.insert([1, 2], D, 1.0)
    t.insert([1, 3], D, 2.0)
    t.insert([6], D, 3.0)
    # Node 1 was used at 2.0, before [6], but it has children on device: leaves go first, LRU first.
    assert t.evict(D, 3) == [5, 2, 3]
    assert t.evict(D, 9) == [1, 6]
    assert t.used_blocks(D) == 0 and t.num_nodes == 0
    t.check_integrity()


def test_parent_outlives_children_even_if_inserted_earlier() -> None:
    t = tree()
    t.insert([1], D, 0.0)
    t.insert([7], D, 1.0)
    t.insert([1, 2], D, 2.0)
    assert t.evict(D, 3) == [7, 2, 1]


def test_eviction_is_per_tier() -> None:
    t = tree()
    t.insert([1, 2], D, 0.0)
    t.insert([1, 2], H, 0.0)
    assert t.evict(H, 1) == [2]
    assert t.match([1, 2]).tiers == (D, D)
    assert t.evict(D, 2) == [2, 1]
    assert t.match([1, 2]).tiers == (H,)
    assert t.num_nodes == 1
    t.check_integrity()


def test_demotion_keeps_lower_tier_leaf_first() -> None:
    t = tree(device=8, host=3)
    t.insert([1], H, 0.0)
    t.insert([1, 2], D, 1.0)
    t.insert([7], H, 2.0)
    assert t.evict(D, 1, demote_to=H) == [2]
    assert t.match([1, 2]).tiers == (D, H)
    # Block 2 is the host's newest; its parent 1 moved after it, so the host still evicts leaf-first.
    assert t.evict(H, 3) == [7, 2, 1]
    t.check_integrity()


def test_demotion_never_overfills_the_lower_tier() -> None:
    t = tree(device=8, host=1)
    t.insert([1, 2], D, 0.0)
    with pytest.raises(SimError):
        t.evict(D, 1, demote_to=D)
    assert t.evict(D, 2, demote_to=H) == [2, 1]
    assert t.used_blocks(H) == 1 and t.used_blocks(D) == 0
    # Only block 2 fitted; block 1 was dropped, so the prefix is gone (callers make room first).
    assert t.match([1, 2]).keys_matched == 0 and t.num_nodes == 2
    t.check_integrity()


def test_insert_evicts_lru_and_returns_keys_for_offload() -> None:
    t = tree(device=3)
    t.insert([1, 2, 3], D, 0.0)
    evicted = t.insert([4, 5], D, 1.0)
    assert evicted == [(3, D), (2, D)]
    assert t.used_blocks(D) == 3
    assert t.match([1, 2, 3]).keys_matched == 1
    # The caller offloads the victims: the prefix comes back, now on host after the device block.
    assert t.insert([1, 2, 3], H, 2.0) == []
    assert t.match([1, 2, 3]).tiers == (D, H, H)
    t.check_integrity()


def test_insert_never_evicts_its_own_path() -> None:
    t = tree(device=3)
    t.insert([1, 2], D, 0.0)
    t.insert([7], D, 1.0)
    # [1, 2] is older than [7], but it is the prefix being extended.
    assert t.insert([1, 2, 3], D, 2.0) == [(7, D)]
    assert t.match([1, 2, 3]).tiers == (D, D, D)
    with pytest.raises(SimError):
        t.insert([1, 2, 3, 4], D, 3.0)
    assert t.match([1, 2, 3, 4]).keys_matched == 3
    t.check_integrity()


def test_insert_survives_pruning_of_its_own_path() -> None:
    t = tree(device=2)
    t.insert([1, 2], D, 0.0)
    assert t.remove_residency([1], D) == [1]  # a hole: block 1 is gone, its child 2 stays
    # Making room evicts block 2, which prunes block 1, the path's last existing node.
    assert t.insert([1, 3], D, 1.0) == [(2, D)]
    assert t.match([1, 3]).tiers == (D, D)
    assert t.num_nodes == 2
    t.check_integrity()


# ----- locks -----


def test_locked_blocks_are_never_evicted() -> None:
    t = tree(device=3, host=3)
    t.insert([1, 2, 3], D, 0.0)
    t.insert([1, 2, 3], H, 0.0)
    t.lock([1, 2])
    assert t.evictable_blocks(D) == 1
    assert t.insert([4], D, 1.0) == [(3, D)]
    assert t.can_insert(1, D) and not t.can_insert(2, D)
    with pytest.raises(SimError, match="locked"):
        t.insert([5, 6], D, 2.0)
    # The failed insert changed nothing.
    assert t.used_blocks(D) == 3 and t.match([5]).keys_matched == 0 and t.num_nodes == 4
    assert t.evict(D, 5) == [4]
    # Locks protect every tier.
    assert t.evict(H, 5) == [3]
    assert t.match([1, 2]).tiers == (D, D)
    t.unlock([1, 2])
    assert t.can_insert(3, D)
    assert t.evict(D, 5) == [2, 1]
    t.check_integrity()


def test_insert_raises_when_everything_is_locked() -> None:
    t = tree(device=2)
    t.insert([1, 2], D, 0.0)
    t.lock([1, 2])
    assert not t.can_insert(1, D)
    with pytest.raises(SimError):
        t.insert([3], D, 1.0)
    t.check_integrity()


def test_unlock_below_zero_asserts() -> None:
    t = tree()
    t.insert([1, 2], D, 0.0)
    t.lock([1, 2])
    with pytest.raises(AssertionError):
        t.unlock([1, 2, 3])
    t.unlock([1, 2])
    with pytest.raises(AssertionError):
        t.unlock([1, 2])
    with pytest.raises(AssertionError):
        t.unlock([1])
    assert t.evictable_blocks(D) == 2
    t.check_integrity()


def test_lock_extends_and_unlock_shortens_a_hold() -> None:
    t = tree()
    t.insert([1, 2, 3], D, 0.0)
    t.lock([1])
    with pytest.raises(AssertionError):
        t.lock([1, 2, 3], start=2)  # no hold ends at [1, 2]
    t.lock([1, 2], start=1)  # the request's hold grows to [1, 2] as block 2 lands
    assert t.evictable_blocks(D) == 1
    with pytest.raises(AssertionError):
        t.lock([1, 2, 3], start=1)  # the hold no longer ends at [1]
    with pytest.raises(AssertionError):
        t.unlock([1])  # only part of the hold: would leave block 2 locked under an unlocked block
    t.unlock([1, 2], start=1)
    assert t.evictable_blocks(D) == 2
    t.unlock([1])
    assert t.evictable_blocks(D) == 3
    with pytest.raises(SimError):
        t.lock([1], start=2)
    t.check_integrity()


def test_unlock_counts_as_a_use() -> None:
    t = tree()
    t.insert([1], D, 0.0)
    t.insert([2], D, 1.0)
    t.lock([1])
    t.unlock([1])
    assert t.evict(D, 1) == [2]


def test_lock_of_unknown_path_creates_and_prunes_nodes() -> None:
    t = tree()
    t.lock([1, 2])
    t.lock([1])
    assert t.num_nodes == 2 and t.match([1, 2]).keys_matched == 0
    t.unlock([1, 2])
    assert t.num_nodes == 1
    t.unlock([1])
    assert t.num_nodes == 0
    t.check_integrity()


def test_remove_residency() -> None:
    t = tree()
    t.insert([1, 2, 3], D, 0.0)
    t.insert([1, 2, 3], H, 0.0)
    assert t.remove_residency([1, 2, 3], H, start=1) == [2, 3]
    assert t.used_blocks(H) == 1
    t.lock([1, 2])
    with pytest.raises(SimError):
        t.remove_residency([1, 2, 3], D)
    assert t.used_blocks(D) == 3
    assert t.remove_residency([1, 2, 3], D, start=2) == [3]
    assert t.remove_residency([1, 2], H) == [1]  # a locked block's non-device copy may go
    t.unlock([1, 2])
    assert t.remove_residency([1, 2, 9], D) == [1, 2]
    assert t.num_nodes == 0
    t.check_integrity()


# ----- transient marks (delay hits) -----


def test_transient_marks_reported_after_device_prefix() -> None:
    t = tree()
    t.insert([1, 2], D, 0.0)
    t.mark_in_queue([1, 2, 3, 4], on=True)
    t.mark_in_flight([1, 2, 3], on=True)
    m = t.match([1, 2, 3, 4, 5])
    assert (m.keys_matched, m.in_queue_blocks, m.in_flight_blocks, m.transient_blocks) == (2, 2, 1, 2)
    # A mark taken twice needs two releases.
    t.mark_in_queue([1, 2, 3, 4], on=True)
    t.mark_in_queue([1, 2, 3, 4], on=False)
    assert t.match([1, 2, 3, 4]).in_queue_blocks == 2
    t.mark_in_queue([1, 2, 3, 4], on=False)
    m = t.match([1, 2, 3, 4])
    assert (m.in_queue_blocks, m.in_flight_blocks, m.transient_blocks) == (0, 1, 1)
    t.mark_in_flight([1, 2, 3], on=False)
    assert t.num_nodes == 2
    with pytest.raises(AssertionError):
        t.mark_in_flight([1, 2], on=False)
    t.check_integrity()


def test_marks_inside_device_prefix_do_not_count() -> None:
    t = tree()
    t.insert([1, 2, 3], D, 0.0)
    t.mark_in_queue([1, 2], on=True)
    assert t.match([1, 2, 3]).in_queue_blocks == 0
    t.insert([1, 2, 3, 4, 5], H, 1.0)
    t.mark_in_flight([1, 2, 3, 4], on=True)
    t.mark_in_queue([1, 2, 3, 4, 5], on=True)
    m = t.match([1, 2, 3, 4, 5])
    assert m.prefix_in(D) == 3
    assert (m.in_flight_blocks, m.in_queue_blocks, m.transient_blocks) == (1, 2, 2)
    t.mark_in_queue([1, 2, 3, 4, 5], on=False)
    m = t.match([1, 2, 3, 4, 5])
    assert (m.in_flight_blocks, m.in_queue_blocks, m.transient_blocks) == (1, 0, 1)
    t.mark_in_flight([1, 2, 3, 4], on=False)
    t.mark_in_queue([1, 2], on=False)
    assert t.match([1, 2, 3, 4, 5]).transient_blocks == 0
    t.check_integrity()


# ----- bounded memory -----


def test_pruning_keeps_node_count_bounded() -> None:
    rng = random.Random(1234)
    device_blocks, host_blocks = 64, 128
    t = tree(device=device_blocks, host=host_blocks)
    for step in range(10_000):
        keys = [rng.randrange(50) for _ in range(rng.randint(1, 8))]
        tier = D if rng.random() < 0.6 else H
        if t.can_insert(len(keys), tier):
            t.insert(keys, tier, float(step))
        if rng.random() < 0.3:
            t.evict(rng.choice([D, H]), rng.randint(1, 16))
        # Each tier holds a prefix-closed set, so every node is resident somewhere.
        assert t.num_nodes <= t.used_blocks(D) + t.used_blocks(H) <= device_blocks + host_blocks
        if step % 1000 == 0:
            t.check_integrity()
    t.evict(D, device_blocks)
    t.evict(H, host_blocks)
    assert t.num_nodes == 0
    t.check_integrity()


# ----- random op sequences against a naive model -----

Path = tuple[int, ...]
CAPACITY = {D: 5, H: 8, S: None, R: 3}


def key_of(path: Path) -> int:
    """A key naming its whole path (like the Mooncake trace's prefix hashes), so that the model can
    map evicted keys back to paths."""
    return int("1" + "".join(str(d) for d in path))


def keys_of(path: Path) -> list[int]:
    return [key_of(path[: i + 1]) for i in range(len(path))]


paths = st.lists(st.integers(0, 2), min_size=0, max_size=4).map(tuple)
tiers = st.sampled_from(list(Tier))


class NaiveTree:
    """Residency, locks and marks per path in plain dicts; LRU per tier by a global touch counter."""

    def __init__(self) -> None:
        self.res: dict[Path, set[Tier]] = {}
        self.lock: dict[Path, int] = {}
        self.marks: dict[str, dict[Path, int]] = {"in_queue": {}, "in_flight": {}}
        self.seq: dict[tuple[Tier, Path], int] = {}
        self.clock = 0

    def held(self, p: Path) -> bool:
        return bool(self.res.get(p) or self.lock.get(p) or any(m.get(p) for m in self.marks.values()))

    def nodes(self) -> set[Path]:
        known = set(self.res) | set(self.lock) | set(self.marks["in_queue"]) | set(self.marks["in_flight"])
        return {p[: i + 1] for p in known if self.held(p) for i in range(len(p))}

    def used(self, tier: Tier) -> int:
        return sum(tier in s for s in self.res.values())

    def bump(self, p: Path, tiers: tuple[Tier, ...] = tuple(Tier)) -> None:
        self.clock += 1
        for tier in tiers:
            self.seq[tier, p] = self.clock

    def touch(self, prefixes: list[Path]) -> None:
        for p in reversed(prefixes):
            self.bump(p)

    def evictable(self, tier: Tier) -> list[Path]:
        return [p for p, s in self.res.items() if tier in s and not self.lock.get(p)]

    def evict(self, tier: Tier, n: int, demote_to: Tier | None = None) -> list[int]:
        out = []
        for _ in range(n):
            leaves = [
                p
                for p in self.evictable(tier)
                if not any(tier in self.res.get((*p, d), ()) for d in range(3))
            ]
            if not leaves:
                break
            victim = min(leaves, key=lambda p: self.seq[tier, p])
            self.res[victim].discard(tier)
            out.append(key_of(victim))
            if demote_to is not None:
                self.demote(victim, demote_to)
        return out

    def demote(self, victim: Path, to: Tier) -> None:
        cap = CAPACITY[to]
        if to not in self.res[victim] and cap is not None and self.used(to) >= cap:
            return
        self.res[victim].add(to)
        self.bump(victim, (to,))
        for i in range(len(victim) - 1, 0, -1):
            if self.lock.get(victim[:i]):
                break
            if to in self.res.get(victim[:i], ()):
                self.bump(victim[:i], (to,))

    def match(self, path: Path) -> Match:
        nodes = self.nodes()
        prefixes = []
        for i in range(len(path)):
            if path[: i + 1] not in nodes:
                break
            prefixes.append(path[: i + 1])
        found = []
        for p in prefixes:
            if not self.res.get(p):
                break
            found.append(min(self.res[p]))
        device = next((i for i, tier in enumerate(found) if tier != D), len(found))
        q = f = n = 0
        for p in prefixes[device:]:
            in_q, in_f = self.marks["in_queue"].get(p, 0), self.marks["in_flight"].get(p, 0)
            if not (in_q or in_f):
                break
            n, q, f = n + 1, q + (in_q > 0), f + (in_f > 0)
        return Match(len(found), tuple(found), q, f, n)


class RadixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tree = HiRadixTree(CAPACITY)
        self.model = NaiveTree()
        self.now_s = 0.0
        self.holds: list[Path] = []  # lock holds, as paths
        self.held_marks: list[tuple[str, Path, int]] = []

    def tick(self) -> float:
        self.now_s += 1.0
        return self.now_s

    @rule(path=paths, tier=tiers, start=st.integers(0, 4))
    def insert(self, path: Path, tier: Tier, start: int) -> None:
        start = min(start, len(path))
        m, cap = self.model, CAPACITY[tier]
        prefixes = [path[: i + 1] for i in range(len(path))]
        nodes = m.nodes()
        existing = [p for p in prefixes if p in nodes]
        need = sum(tier not in m.res.get(p, ()) for p in prefixes[start:])
        deficit = 0 if cap is None else m.used(tier) + need - cap
        protected = sum(tier in m.res.get(p, ()) and not m.lock.get(p) for p in existing)
        if deficit > len(m.evictable(tier)) - protected:
            with pytest.raises(SimError):
                self.tree.insert(keys_of(path), tier, self.tick(), start)
            return
        expected: list[int] = []
        if deficit > 0:
            m.touch(existing)
            expected = m.evict(tier, deficit)
        for p in prefixes[start:]:
            m.res.setdefault(p, set()).add(tier)
        m.touch(prefixes if start < len(path) else [p for p in prefixes if p in m.nodes()])
        assert self.tree.insert(keys_of(path), tier, self.tick(), start) == [(k, tier) for k in expected]

    @rule(tier=tiers, n=st.integers(0, 4), demote_to=st.none() | tiers)
    def evict(self, tier: Tier, n: int, demote_to: Tier | None) -> None:
        if demote_to == tier:
            with pytest.raises(SimError):
                self.tree.evict(tier, n, demote_to)
            return
        assert self.tree.evict(tier, n, demote_to) == self.model.evict(tier, n, demote_to)

    @rule(path=paths, touch=st.booleans())
    def match(self, path: Path, touch: bool) -> None:
        expected = self.model.match(path)
        assert self.tree.match(keys_of(path), self.tick() if touch else None) == expected
        if touch:
            self.model.touch([path[: i + 1] for i in range(expected.keys_matched)])

    def add_locks(self, path: Path, start: int, delta: int) -> None:
        freed = []
        for i in range(start, len(path)):
            self.model.lock[path[: i + 1]] = self.model.lock.get(path[: i + 1], 0) + delta
            if not self.model.lock[path[: i + 1]]:
                freed.append(path[: i + 1])
        self.model.touch(freed)

    @rule(path=paths.filter(bool))
    def lock(self, path: Path) -> None:
        self.tree.lock(keys_of(path))
        self.add_locks(path, 0, +1)
        self.holds.append(path)

    @precondition(lambda self: self.holds)
    @rule(data=st.data(), extension=paths)
    def extend_lock(self, data: st.DataObject, extension: Path) -> None:
        i = data.draw(st.integers(0, len(self.holds) - 1))
        hold, path = self.holds[i], self.holds[i] + extension
        self.tree.lock(keys_of(path), start=len(hold))
        self.add_locks(path, len(hold), +1)
        self.holds[i] = path

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.holds) - 1))
        hold = self.holds[i]
        start = data.draw(st.integers(0, len(hold) - 1))
        self.tree.unlock(keys_of(hold), start=start)
        self.add_locks(hold, start, -1)
        if start:
            self.holds[i] = hold[:start]
        else:
            del self.holds[i]

    @rule(path=paths.filter(bool))
    def unlock_unheld_path_asserts(self, path: Path) -> None:
        if path not in self.holds:
            with pytest.raises(AssertionError):
                self.tree.unlock(keys_of(path))

    @rule(path=paths, field=st.sampled_from(["in_queue", "in_flight"]), start=st.integers(0, 4))
    def mark(self, path: Path, field: str, start: int) -> None:
        start = min(start, len(path))
        getattr(self.tree, f"mark_{field}")(keys_of(path), on=True, start=start)
        marks = self.model.marks[field]
        for i in range(start, len(path)):
            marks[path[: i + 1]] = marks.get(path[: i + 1], 0) + 1
        self.held_marks.append((field, path, start))

    @precondition(lambda self: self.held_marks)
    @rule(data=st.data())
    def unmark(self, data: st.DataObject) -> None:
        field, path, start = self.held_marks.pop(data.draw(st.integers(0, len(self.held_marks) - 1)))
        getattr(self.tree, f"mark_{field}")(keys_of(path), on=False, start=start)
        for i in range(start, len(path)):
            self.model.marks[field][path[: i + 1]] -= 1

    @rule(path=paths, tier=tiers, start=st.integers(0, 4))
    def remove_residency(self, path: Path, tier: Tier, start: int) -> None:
        start = min(start, len(path))
        m = self.model
        nodes = m.nodes()
        targets = [
            path[: i + 1]
            for i in range(start, len(path))
            if path[: i + 1] in nodes and tier in m.res.get(path[: i + 1], ())
        ]
        if tier == D and any(m.lock.get(p) for p in targets):
            with pytest.raises(SimError):
                self.tree.remove_residency(keys_of(path), tier, start)
            return
        assert self.tree.remove_residency(keys_of(path), tier, start) == [key_of(p) for p in targets]
        for p in targets:
            m.res[p].discard(tier)

    @invariant()
    def agrees_with_model(self) -> None:
        self.tree.check_integrity()
        for tier in Tier:
            cap = CAPACITY[tier]
            assert self.tree.used_blocks(tier) == self.model.used(tier)
            assert cap is None or self.tree.used_blocks(tier) <= cap
            assert self.tree.evictable_blocks(tier) == len(self.model.evictable(tier))
        assert self.tree.num_nodes == len(self.model.nodes())
        expected = {(tuple(keys_of(p)), tier) for p, s in self.model.res.items() for tier in s}
        assert set(self.tree.iter_residency()) == expected


RadixMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_random_ops_match_naive_model = RadixMachine.TestCase
