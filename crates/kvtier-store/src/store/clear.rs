//! Clearing the namespace ([`Store::clear`]), and the gate that makes a clear a barrier within
//! this process.
//!
//! **The gate.** Every call that writes a tier or reads block bytes holds the store's `gate`
//! (an `RwLock<()>`) for reading from its first step to its last: `put`, `put_from_pool` (and
//! their `_since` forms), `load`, `load_range`, `load_range_stored`, `load_into_pool`,
//! `promote_decoded`, `report_undecodable`. Everything those calls write goes through them: the
//! DRAM insert, demotion of DRAM's victims to SSD and to a write-back remote tier, SSD and remote
//! write-through, promotion into DRAM on a hit (on the load's own thread or the one it spawns),
//! and the transfer engine's store jobs and promotions (which call these). Calls proceed together
//! (the read side is one atomic operation when no clear waits). `clear` takes the gate for
//! writing, so it waits for the calls in flight to finish and the calls that arrive meanwhile
//! wait for it (a pending clear holds new readers back, so a stream of puts cannot starve it).
//! When `clear` returns, therefore:
//! - no write that began before it can still land: each finished before the tiers were cleared;
//! - no load returns bytes put before it: a load in flight finished before; a lease granted
//!   before the clear is *cleared* (its pins dropped, its blocks gone) and loads from it miss
//!   (counted in `load_missing`), as do promotions of what it read (`promote_decoded`);
//! - leases and lookups granted after it see only blocks put after it.
//!
//! `lease` and `lookup` do not take the gate: the transfer engine leases while holding its job
//! table, which a paged load's layer callback takes inside the gate, so a lease waiting on the
//! gate could deadlock a clear. A lease racing a clear is harmless: the clear clears every lease
//! after the tiers, under the lease table's lock, so a lease granted before that point is cleared;
//! a lease whose search of the tiers overlapped the clear is granted cleared (`leasing.rs`); and
//! one whose search began after the clear finds the cleared tiers.
//!
//! **Writes that began before the store call.** A caller holding KV computed before a clear (a
//! queued store job) marks when its write began with [`Store::epoch`] and stores it with
//! [`Store::put_since`] or [`Store::put_from_pool_since`]: if a clear began since, nothing is
//! stored ([`StoreError::ClearedSince`]). The transfer engine does this for every store job, from
//! its submission.
//!
//! **Out of scope: other processes.** The gate is this store's: another process sharing the
//! SSD directory (not possible: one store per directory holds its lock) or the Redis namespace
//! (possible: several servers, or a trainer's second engine) is not fenced. A remote write it
//! makes while this clear scans may survive the clear, and it may write old-weights KV after it;
//! clear every process that serves the namespace. Likewise a remote `SET` whose reply this
//! process gave up on (`io_timeout`: the connection is dropped, counted as a failed write) may
//! still be applied by the server later.
//!
//! Deadlock freedom: a thread takes the gate once per call and never while holding the lease
//! table or a tier lock (nothing inside a gated call calls another gated call; a load's
//! promotion thread runs inside its load's gate and does not take it again), and nothing a gated
//! call waits on (tier locks, device I/O, the server, the transfer engine's job table) is held
//! by a thread waiting for the gate.

use std::sync::atomic::Ordering;

use kvtier_core::paged::PagedPool;
use kvtier_core::BlockKey;
use parking_lot::RwLockReadGuard;

use super::Store;
use crate::error::StoreError;
use crate::hooks::HookPoint;
use crate::types::PutReport;

impl Store {
    /// Clears begun so far on this store. A caller that computed KV before storing it later
    /// reads this first and stores with [`put_since`](Self::put_since), so a clear in between
    /// drops the write instead of letting it land.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// The gate for a write or a load (see the module docs); held until the guard drops.
    pub(super) fn enter(&self) -> RwLockReadGuard<'_, ()> {
        self.gate.read()
    }

    /// The gate for a write that began at `epoch`: an error if a clear began since.
    fn enter_since(&self, epoch: u64) -> Result<RwLockReadGuard<'_, ()>, StoreError> {
        let guard = self.gate.read();
        let now = self.epoch();
        if now != epoch {
            return Err(StoreError::ClearedSince { since: epoch, now });
        }
        Ok(guard)
    }

    /// [`put`](Self::put) of a write that began at `epoch` (an earlier [`epoch`](Self::epoch)):
    /// [`StoreError::ClearedSince`], storing nothing, if a clear began since.
    pub fn put_since(
        &self,
        epoch: u64,
        namespace_hash: u128,
        keys: &[BlockKey],
        objects: &[&[u8]],
    ) -> Result<PutReport, StoreError> {
        let _writing = self.enter_since(epoch)?;
        self.put_entered(namespace_hash, keys, objects)
    }

    /// [`put_from_pool`](Self::put_from_pool) of a write that began at `epoch`, as
    /// [`put_since`](Self::put_since).
    pub fn put_from_pool_since(
        &self,
        epoch: u64,
        namespace_hash: u128,
        keys: &[BlockKey],
        pool: &PagedPool,
        block_ids: &[u64],
    ) -> Result<PutReport, StoreError> {
        let _writing = self.enter_since(epoch)?;
        self.put_from_pool_entered(namespace_hash, keys, pool, block_ids)
    }

    /// Drops every block of this store's namespace from every tier; other namespaces sharing an
    /// SSD pool or a Redis keep theirs. What an engine asks when its weights change (vLLM's
    /// `reset_prefix_cache(reset_connector=True)`, SGLang's storage-backend clear).
    ///
    /// A barrier within this process (module docs): it waits for the puts and loads in flight,
    /// holds new ones back while it runs, and on return no write that began before it can land
    /// and no load returns bytes put before it; leases granted before it load nothing. Writers in
    /// other processes sharing the remote tier are not fenced.
    ///
    /// A tier that cannot be cleared (Redis down) is the error, after the others were cleared.
    /// Returns how many blocks were dropped.
    pub fn clear(&self) -> Result<usize, StoreError> {
        let _exclusive = match self.gate.try_write() {
            Some(guard) => guard,
            None => {
                self.hierarchy.hooks.at(HookPoint::ClearWaits);
                self.gate.write()
            }
        };
        self.epoch.fetch_add(1, Ordering::SeqCst);
        let mut dropped = 0;
        let mut failed = None;
        for tier in self.tiers() {
            match tier.clear(self.namespace_hash) {
                Ok(n) => dropped += n,
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        // After the tiers: a lease granted meanwhile (leases skip the gate) is cleared too.
        let mut table = self.leases.lock();
        let blocks = table.clear_all();
        self.unpin(&blocks);
        drop(table);
        failed.map_or(Ok(dropped), |e| Err(e.into()))
    }

    /// Installs a hook the store calls at each [`HookPoint`](crate::HookPoint) it passes (`None`
    /// removes it): tests hold a call there to run another against it.
    #[cfg(feature = "test-hooks")]
    pub fn set_hook_for_test(&self, hook: Option<crate::hooks::Hook>) {
        self.hierarchy.hooks.set(hook);
    }
}
