//! The lease table: which pinned block generations each lease holds, until when.
//!
//! A lease pins its blocks in their tiers so eviction cannot remove them between "exists" and
//! "loaded". It ends by `release`, or when its TTL passes (a crashed or forgetful caller must
//! not pin the cache forever). A lease being loaded from is never reclaimed mid-copy: release
//! or expiry of a lease with loads in flight is deferred to the last load's end.
//!
//! Ids grow by one per grant and every lease gets the same TTL, so deadlines are nondecreasing
//! in id order: expiry scans from the oldest id and stops at the first live deadline, O(expired).
//!
//! An id is *granted* iff `1 <= id < next_id`; a granted id not live in the table has *ended*
//! (released, or expired). That needs no per-id memory, so:
//! - `release` is idempotent: it is `Ok` for every granted id, live, expired (however long
//!   ago) or already released; only a never-granted id is [`StoreError::LeaseUnknown`].
//! - a load from an ended lease is [`StoreError::LeaseExpired`] while the table still holds it
//!   or it is among the last `leases_max` expiries remembered for the message, else
//!   [`StoreError::LeaseEnded`]. Only the wording depends on that bounded memory.
//!
//! A clear ([`LeaseTable::clear_all`]) unpins every lease's blocks but keeps the leases: each is
//! *cleared*, and a load from it misses (its blocks left the store), as the blocks of a lease
//! located after the clear would.
//!
//! A lease is granted in two steps, so the table's lock is not held while the tiers are searched
//! (a remote tier's EXISTS waits on the server, and every put, load and release takes this
//! lock): [`reserve`](LeaseTable::reserve) takes a place under the bound, the caller locates and
//! pins its blocks without the lock, and [`grant`](LeaseTable::grant) registers them. A clear
//! that overlapped the search (one began, or one's [`clear_all`](LeaseTable::clear_all) ran,
//! between the reservation and the grant) makes the caller grant the lease cleared.
//!
//! Invariants: `leases.len() + reserved <= leases_max`; a lease's blocks stay pinned exactly as
//! long as it is in the table and not cleared; a released lease stays only while loads are in
//! flight.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use kvtier_pool::EntryRef;

use crate::error::StoreError;

/// One pinned block: its tier (index into the store's hierarchy) and generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct LeasedBlock {
    pub tier: usize,
    pub entry: EntryRef,
}

#[derive(Debug)]
struct LeaseEntry {
    /// The pinned blocks (none once cleared).
    blocks: Vec<LeasedBlock>,
    /// Blocks the lease was granted (what a load may ask for, cleared or not).
    hit_blocks: usize,
    /// A clear dropped the namespace's blocks since the grant: loads miss.
    cleared: bool,
    deadline: Instant,
    loads_in_flight: u32,
    released: bool,
}

#[derive(Debug)]
pub(crate) struct LeaseTable {
    leases: BTreeMap<u64, LeaseEntry>,
    /// Recently expired ids (at most `leases_max`), so a load from one says "expired" rather
    /// than "ended". Error wording only: whether an id was granted is `id < next_id`.
    expired_ids: BTreeSet<u64>,
    next_id: u64,
    ttl: Duration,
    leases_max: usize,
    released_in_flight: usize,
    /// Places taken by [`reserve`](Self::reserve) whose lease is not granted yet.
    reserved: usize,
    /// [`clear_all`](Self::clear_all) calls so far.
    clears: u64,
    pub expired_total: u64,
}

impl LeaseTable {
    pub fn new(ttl: Duration, leases_max: usize) -> Self {
        LeaseTable {
            leases: BTreeMap::new(),
            expired_ids: BTreeSet::new(),
            next_id: 1,
            ttl,
            leases_max,
            released_in_flight: 0,
            reserved: 0,
            clears: 0,
            expired_total: 0,
        }
    }

    /// Leases granted and neither released nor expired.
    pub fn active(&self) -> usize {
        self.leases.len() - self.released_in_flight
    }

    /// Whether `id` was ever returned by [`grant`](Self::grant).
    fn granted(&self, id: u64) -> bool {
        (1..self.next_id).contains(&id)
    }

    /// The error for a load from `id`, which is not live (not in the table, or released).
    fn not_live(&self, id: u64) -> StoreError {
        if self.expired_ids.contains(&id) {
            StoreError::LeaseExpired { id }
        } else if self.granted(id) {
            StoreError::LeaseEnded { id }
        } else {
            StoreError::LeaseUnknown { id }
        }
    }

    /// Removes every expired lease without loads in flight; returns the blocks to unpin.
    pub fn reclaim_expired(&mut self, now: Instant) -> Vec<LeasedBlock> {
        let mut ids = Vec::new();
        for (&id, lease) in &self.leases {
            if lease.deadline > now {
                break;
            }
            if lease.loads_in_flight == 0 {
                ids.push(id);
            }
        }
        let mut blocks = Vec::new();
        for id in ids {
            let lease = self.leases.remove(&id).expect("id just seen");
            assert!(!lease.released, "a released lease without loads stayed in the table");
            blocks.extend(lease.blocks);
            self.expired_total += 1;
            self.expired_ids.insert(id);
            if self.expired_ids.len() > self.leases_max {
                self.expired_ids.pop_first();
            }
        }
        blocks
    }

    /// Takes a place for a lease to be [`grant`](Self::grant)ed, or gives it back with
    /// [`unreserve`](Self::unreserve); [`StoreError::LeaseLimit`] when leases and reservations
    /// fill the bound (call after reclaiming).
    pub fn reserve(&mut self) -> Result<(), StoreError> {
        if self.leases.len() + self.reserved >= self.leases_max {
            return Err(StoreError::LeaseLimit { max: self.leases_max });
        }
        self.reserved += 1;
        Ok(())
    }

    /// Gives back a place [`reserve`](Self::reserve) took, granting nothing.
    pub fn unreserve(&mut self) {
        self.reserved = self.reserved.checked_sub(1).expect("unreserve without a reservation");
    }

    /// Places reserved whose lease is not granted yet (leases being located).
    pub fn reserved(&self) -> usize {
        self.reserved
    }

    /// [`clear_all`](Self::clear_all) calls so far: a caller that reads it at its reservation
    /// and again at its grant knows whether one ran in between.
    pub fn clears(&self) -> u64 {
        self.clears
    }

    /// Registers a lease in a place [`reserve`](Self::reserve) took; returns its id. It holds
    /// `blocks` (already pinned) and `hit_blocks` of them may be loaded; a `cleared` lease holds
    /// no blocks (the caller unpinned them) and its loads miss, as after a clear.
    pub fn grant(&mut self, blocks: Vec<LeasedBlock>, hit_blocks: usize, cleared: bool, now: Instant) -> u64 {
        assert!(cleared || blocks.len() == hit_blocks, "an uncleared lease holds its hit blocks");
        assert!(!cleared || blocks.is_empty(), "a cleared lease holds no blocks");
        self.unreserve();
        assert!(self.leases.len() < self.leases_max, "lease limit checked at the reservation");
        let deadline = now + self.ttl;
        if let Some((_, last)) = self.leases.last_key_value() {
            assert!(last.deadline <= deadline, "lease deadlines must grow with ids");
        }
        let id = self.next_id;
        self.next_id += 1;
        let entry = LeaseEntry { blocks, hit_blocks, cleared, deadline, loads_in_flight: 0, released: false };
        self.leases.insert(id, entry);
        id
    }

    fn live(&mut self, id: u64, now: Instant) -> Result<&mut LeaseEntry, StoreError> {
        let error = match self.leases.get(&id) {
            Some(lease) if !lease.released && lease.deadline > now => None,
            Some(lease) if !lease.released => Some(StoreError::LeaseExpired { id }),
            _ => Some(self.not_live(id)),
        };
        match error {
            None => Ok(self.leases.get_mut(&id).expect("a live lease is in the table")),
            Some(error) => Err(error),
        }
    }

    /// Starts a load of the first `count` blocks (tests; the store loads ranges).
    #[cfg(test)]
    pub fn begin_load(
        &mut self,
        id: u64,
        count: usize,
        now: Instant,
    ) -> Result<Option<Vec<LeasedBlock>>, StoreError> {
        self.begin_load_at(id, 0, count, now)
    }

    /// Starts a load of blocks `first..first + count`; returns them, or `None` when a clear
    /// dropped them since the grant (the load misses). Must be paired with `end_load`.
    pub fn begin_load_at(
        &mut self,
        id: u64,
        first: usize,
        count: usize,
        now: Instant,
    ) -> Result<Option<Vec<LeasedBlock>>, StoreError> {
        let lease = self.live(id, now)?;
        let end = first.saturating_add(count);
        if end > lease.hit_blocks {
            return Err(StoreError::LoadTooMany { requested: end, leased: lease.hit_blocks });
        }
        lease.loads_in_flight += 1;
        Ok((!lease.cleared).then(|| lease.blocks[first..end].to_vec()))
    }

    /// A clear: every lease's blocks are unpinned (returned, for the caller to unpin) and its
    /// loads miss from now on; the leases themselves stay until released or expired. The caller
    /// keeps loads out meanwhile (the store's gate), so none is in flight.
    pub fn clear_all(&mut self) -> Vec<LeasedBlock> {
        assert_eq!(self.released_in_flight, 0, "a clear ran while a load was in flight");
        self.clears += 1;
        let mut blocks = Vec::new();
        for lease in self.leases.values_mut() {
            assert_eq!(lease.loads_in_flight, 0, "a clear ran while a load was in flight");
            lease.cleared = true;
            blocks.append(&mut lease.blocks);
        }
        blocks
    }

    /// Ends a load; returns the blocks to unpin if the lease was released meanwhile.
    pub fn end_load(&mut self, id: u64) -> Option<Vec<LeasedBlock>> {
        let lease = self.leases.get_mut(&id).expect("a lease with a load in flight stays in the table");
        assert!(lease.loads_in_flight > 0, "end_load without begin_load");
        lease.loads_in_flight -= 1;
        if lease.released && lease.loads_in_flight == 0 {
            self.released_in_flight -= 1;
            return self.leases.remove(&id).map(|lease| lease.blocks);
        }
        None
    }

    /// Ends a lease. Returns the blocks to unpin now, or `None` when there is nothing to unpin
    /// now: loads are in flight (the last one unpins), or the lease had already ended. Idempotent:
    /// releasing an expired (however long ago) or already released lease is `Ok`, since its pins
    /// are gone or going; only an id never granted is an error.
    pub fn release(&mut self, id: u64) -> Result<Option<Vec<LeasedBlock>>, StoreError> {
        let granted = self.granted(id);
        match self.leases.get_mut(&id) {
            Some(lease) if !lease.released => {
                if lease.loads_in_flight > 0 {
                    lease.released = true;
                    self.released_in_flight += 1;
                    return Ok(None);
                }
                Ok(self.leases.remove(&id).map(|lease| lease.blocks))
            }
            _ if granted => Ok(None),
            _ => Err(StoreError::LeaseUnknown { id }),
        }
    }

    /// Pins every lease in the table holds, per (tier, entry).
    pub fn expected_pins(&self) -> HashMap<(usize, EntryRef), u32> {
        let mut pins = HashMap::new();
        for block in self.leases.values().flat_map(|lease| &lease.blocks) {
            *pins.entry((block.tier, block.entry)).or_insert(0) += 1;
        }
        pins
    }

    pub fn check_integrity(&self) -> Result<(), String> {
        if self.leases.len() + self.reserved > self.leases_max {
            return Err(format!(
                "{} leases held and {} reserved; bound is {}",
                self.leases.len(),
                self.reserved,
                self.leases_max
            ));
        }
        let released = self.leases.values().filter(|l| l.released).count();
        if released != self.released_in_flight {
            return Err(format!(
                "{released} released leases in the table; counted {}",
                self.released_in_flight
            ));
        }
        if let Some((id, _)) = self.leases.iter().find(|(_, l)| l.released && l.loads_in_flight == 0) {
            return Err(format!("lease {id} was released with no load in flight but is still held"));
        }
        let deadlines: Vec<Instant> = self.leases.values().map(|l| l.deadline).collect();
        if deadlines.windows(2).any(|w| w[0] > w[1]) {
            return Err("lease deadlines do not grow with ids".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(key: u128) -> LeasedBlock {
        LeasedBlock { tier: 0, entry: EntryRef { key, entry_id: key as u64 } }
    }

    /// Reserves and grants a lease of `blocks`, none cleared.
    fn grant(t: &mut LeaseTable, blocks: Vec<LeasedBlock>, now: Instant) -> u64 {
        t.reserve().unwrap();
        let hit_blocks = blocks.len();
        t.grant(blocks, hit_blocks, false, now)
    }

    #[test]
    fn expiry_is_ordered_and_remembered() {
        let mut t = LeaseTable::new(Duration::from_secs(10), 8);
        let t0 = Instant::now();
        let a = grant(&mut t, vec![block(1)], t0);
        let b = grant(&mut t, vec![block(2)], t0 + Duration::from_secs(5));
        assert!(t.reclaim_expired(t0 + Duration::from_secs(9)).is_empty());
        assert_eq!(t.reclaim_expired(t0 + Duration::from_secs(10)), vec![block(1)]);
        assert_eq!(t.begin_load(a, 1, t0), Err(StoreError::LeaseExpired { id: a }));
        assert_eq!(t.release(a), Ok(None), "releasing an expired lease is harmless");
        assert_eq!(t.release(b), Ok(Some(vec![block(2)])));
        assert_eq!(t.release(b), Ok(None), "releasing twice is harmless");
        assert_eq!(t.begin_load(b, 1, t0), Err(StoreError::LeaseEnded { id: b }));
        assert_eq!(t.release(99), Err(StoreError::LeaseUnknown { id: 99 }));
        assert_eq!(t.release(0), Err(StoreError::LeaseUnknown { id: 0 }));
        assert_eq!(t.expired_total, 1);
    }

    #[test]
    fn expired_ids_release_after_the_expiry_memory_is_trimmed() {
        let mut t = LeaseTable::new(Duration::from_secs(1), 2);
        let t0 = Instant::now();
        let ids: Vec<u64> = (0..6u32)
            .map(|i| {
                let now = t0 + Duration::from_secs(2 * u64::from(i));
                t.reclaim_expired(now);
                grant(&mut t, vec![block(u128::from(i))], now)
            })
            .collect();
        assert_eq!(t.reclaim_expired(t0 + Duration::from_secs(100)), vec![block(5)]);
        assert_eq!(t.expired_total, 6);
        for &id in &ids {
            assert_eq!(t.release(id), Ok(None), "lease {id} expired; releasing it is harmless");
        }
        let (oldest, newest) = (ids[0], ids[5]);
        assert_eq!(t.begin_load(oldest, 0, t0), Err(StoreError::LeaseEnded { id: oldest }));
        assert_eq!(t.begin_load(newest, 0, t0), Err(StoreError::LeaseExpired { id: newest }));
        assert_eq!(t.active(), 0);
        t.check_integrity().unwrap();
    }

    #[test]
    fn releasing_again_while_a_load_is_in_flight_is_harmless() {
        let mut t = LeaseTable::new(Duration::from_secs(1), 8);
        let t0 = Instant::now();
        let id = grant(&mut t, vec![block(1)], t0);
        t.begin_load(id, 1, t0).unwrap();
        assert_eq!(t.release(id), Ok(None));
        assert_eq!(t.release(id), Ok(None));
        assert_eq!(t.begin_load(id, 1, t0), Err(StoreError::LeaseEnded { id }));
        t.check_integrity().unwrap();
        assert_eq!(t.end_load(id), Some(vec![block(1)]));
        t.check_integrity().unwrap();
    }

    #[test]
    fn loads_in_flight_defer_release_and_expiry() {
        let mut t = LeaseTable::new(Duration::from_secs(1), 8);
        let t0 = Instant::now();
        let id = grant(&mut t, vec![block(1), block(2)], t0);
        assert_eq!(t.begin_load(id, 3, t0), Err(StoreError::LoadTooMany { requested: 3, leased: 2 }));
        assert_eq!(t.begin_load(id, 2, t0).unwrap().map(|b| b.len()), Some(2));
        assert!(t.reclaim_expired(t0 + Duration::from_secs(5)).is_empty(), "not expired mid-load");
        assert_eq!(t.release(id), Ok(None));
        assert_eq!(t.active(), 0);
        t.check_integrity().unwrap();
        assert_eq!(t.end_load(id), Some(vec![block(1), block(2)]));
        assert!(t.expected_pins().is_empty());
        t.check_integrity().unwrap();
    }

    #[test]
    fn a_clear_unpins_every_lease_and_its_loads_miss() {
        let mut t = LeaseTable::new(Duration::from_secs(10), 8);
        let t0 = Instant::now();
        let a = grant(&mut t, vec![block(1), block(2)], t0);
        let b = grant(&mut t, vec![block(3)], t0);
        assert_eq!(t.clear_all(), vec![block(1), block(2), block(3)]);
        assert!(t.expected_pins().is_empty(), "a cleared lease pins nothing");
        assert_eq!(t.begin_load(a, 2, t0), Ok(None), "a cleared lease's load misses");
        assert_eq!(t.end_load(a), None);
        assert_eq!(t.begin_load(a, 3, t0), Err(StoreError::LoadTooMany { requested: 3, leased: 2 }));
        assert_eq!(t.active(), 2, "cleared leases stay until released");
        assert_eq!(t.release(b), Ok(Some(vec![])));
        t.check_integrity().unwrap();
    }

    #[test]
    fn limit_counts_reservations_and_a_returned_one_frees_its_place() {
        let mut t = LeaseTable::new(Duration::from_secs(1), 2);
        let now = Instant::now();
        grant(&mut t, vec![], now);
        t.reserve().unwrap();
        assert_eq!(t.reserve(), Err(StoreError::LeaseLimit { max: 2 }), "a reservation holds a place");
        t.check_integrity().unwrap();
        t.unreserve();
        t.reserve().unwrap();
        t.grant(vec![], 0, false, now);
        assert_eq!(t.reserve(), Err(StoreError::LeaseLimit { max: 2 }));
        t.check_integrity().unwrap();
    }

    #[test]
    fn a_lease_granted_cleared_pins_nothing_and_its_loads_miss() {
        let mut t = LeaseTable::new(Duration::from_secs(10), 8);
        let t0 = Instant::now();
        let before = t.clears();
        grant(&mut t, vec![block(1)], t0);
        t.reserve().unwrap();
        assert_eq!(t.clear_all(), vec![block(1)]);
        assert_eq!(t.clears(), before + 1, "the caller sees a clear between reserve and grant");
        let id = t.grant(vec![], 2, true, t0);
        assert!(t.expected_pins().is_empty());
        assert_eq!(t.begin_load(id, 2, t0), Ok(None), "a cleared lease's load misses");
        assert_eq!(t.end_load(id), None);
        assert_eq!(t.begin_load(id, 3, t0), Err(StoreError::LoadTooMany { requested: 3, leased: 2 }));
        assert_eq!(t.release(id), Ok(Some(vec![])));
        t.check_integrity().unwrap();
    }
}
