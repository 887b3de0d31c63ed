//! Granting a lease ([`Store::lease`]) without holding the lease table's lock while the tiers
//! are searched.
//!
//! Locating a block may wait on the remote server (its EXISTS, up to `io_timeout` when the
//! server hangs), and every put, load and release takes the lease table's lock: held across the
//! search, one slow remote lookup stalled DRAM hits and puts of every other request. So a lease
//! takes the lock twice, briefly: to reserve a place under `leases_max` (noting the clear epoch
//! and how many clears the table has seen), and to grant. The search and the pins run between.
//!
//! **A clear during the search.** The search may pin a block a concurrent clear is about to drop
//! (or has dropped from its index but not yet freed, since it is pinned). The lease must then not
//! load it: the clear is a barrier (`clear.rs`). A clear that overlaps the search either began
//! after the reservation (the epoch moved) or had begun and cleared the lease table after it
//! (the table's clear count moved); in both cases the lease is granted *cleared*: its pins are
//! dropped and its loads miss, as a lease granted just before the clear would. A clear whose
//! lease-table step comes after the grant clears the lease itself. A clear that had finished
//! before the reservation changes neither, and the search saw the cleared tiers.

use std::time::Instant;

use kvtier_core::BlockKey;

use super::Store;
use crate::error::StoreError;
use crate::hooks::HookPoint;
use crate::lease::LeasedBlock;
use crate::types::Lease;

/// A place in the lease table taken for a lease being located; given back if it is dropped
/// ungranted (a panic mid-search must not shrink the bound for good).
struct Reservation<'a> {
    store: &'a Store,
    /// The store's clear epoch and the table's clear count at the reservation.
    epoch: u64,
    clears: u64,
    granted: bool,
}

impl<'a> Reservation<'a> {
    fn take(store: &'a Store) -> Result<Self, StoreError> {
        let mut table = store.leases.lock();
        store.reclaim_expired(&mut table);
        table.reserve()?;
        Ok(Reservation { store, epoch: store.epoch(), clears: table.clears(), granted: false })
    }

    /// Grants the lease of `blocks` (pinned); cleared, with its pins dropped, if a clear
    /// overlapped the search (module docs). Returns its id.
    fn grant(mut self, mut blocks: Vec<LeasedBlock>) -> u64 {
        let store = self.store;
        let mut table = store.leases.lock();
        let hit_blocks = blocks.len();
        let cleared = store.epoch() != self.epoch || table.clears() != self.clears;
        if cleared {
            store.unpin(&blocks);
            blocks.clear();
        }
        self.granted = true;
        table.grant(blocks, hit_blocks, cleared, Instant::now())
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.granted {
            self.store.leases.lock().unreserve();
        }
    }
}

impl Store {
    /// Like [`lookup`](Self::lookup), and pins the hit prefix so eviction cannot remove it
    /// until [`release`](Self::release) or `lease_ttl` passes. The lease table's lock is not
    /// held while the tiers are searched; a lease whose search overlapped a
    /// [`clear`](Self::clear) is granted cleared (its loads miss), as a lease granted before
    /// the clear is (module docs). [`StoreError::LeaseLimit`] when `leases_max` leases are
    /// held or being granted.
    pub fn lease(&self, namespace_hash: u128, keys: &[BlockKey]) -> Result<Lease, StoreError> {
        self.check_namespace(namespace_hash)?;
        let reservation = Reservation::take(self)?;
        let mut located = vec![None; keys.len()];
        let hit_blocks = self.locate(keys, &mut located, true);
        let mut tiers = Vec::with_capacity(hit_blocks);
        let mut blocks = Vec::with_capacity(hit_blocks);
        for l in located[..hit_blocks].iter().map(|l| l.expect("prefix is located")) {
            tiers.push(l.tier);
            blocks.push(LeasedBlock { tier: self.tier_index(l.tier), entry: l.entry });
        }
        self.hierarchy.hooks.at(HookPoint::LeaseLocated);
        let id = reservation.grant(blocks);
        Ok(Lease { id, hit_blocks, tiers })
    }
}
