//! The store and an engine's paged pool ([`PagedPool`]), without staging objects where it can.
//!
//! - Loads: DRAM blocks go straight into the pool with one copy, layer by layer
//!   ([`DramTier::read_pinned_into_pool`]); blocks of lower tiers are read and verified (and
//!   decoded, and promoted) as a load reads them, then scattered layer by layer in the same pass,
//!   so `layer_done(l)` means layer `l` of *every* block is in place.
//! - Puts: with DRAM as the only tier, each pool block is gathered straight into its arena extent
//!   ([`DramTier::put_from_pool`]); with lower tiers (whose write-through, demotion and codecs
//!   take whole objects) through one staging object per block, then as [`Store::put`]. Staging
//!   memory is reused across calls (`staging.rs`): fresh pages cost more than the copies.
//!
//! [`DramTier::read_pinned_into_pool`]: kvtier_pool::DramTier::read_pinned_into_pool
//! [`DramTier::put_from_pool`]: kvtier_pool::DramTier::put_from_pool

use kvtier_core::copy;
use kvtier_core::paged::PagedPool;
use kvtier_core::{BlockKey, LayoutError};
use kvtier_pool::{ReadOutcome, TierKind};

use super::Store;
use crate::error::StoreError;
use crate::hooks::HookPoint;
use crate::types::{HierarchyPut, PoolLoadReport, PutReport, TierWrites};

impl Store {
    /// Copies leased blocks `first..first + block_ids.len()` into pool blocks `block_ids`,
    /// verifying each, and calls `layer_done(l)` as soon as layer `l` of every block is in place
    /// (the bytes of a block that later fails verification included: see
    /// [`PoolLoadReport::failed`], and drop what was computed from such a block).
    ///
    /// Errors, before anything is copied: the lease errors of a load; the pool's object size is
    /// not `block_bytes` ([`StoreError::ObjectSize`]); a block id out of range or repeated
    /// ([`StoreError::Layout`]).
    pub fn load_into_pool(
        &self,
        lease_id: u64,
        first: usize,
        pool: &PagedPool,
        block_ids: &[u64],
        layer_done: &mut dyn FnMut(usize),
    ) -> Result<PoolLoadReport, StoreError> {
        if pool.block_bytes() != self.block_bytes {
            return Err(StoreError::ObjectSize {
                index: 0,
                actual: pool.block_bytes(),
                expected: self.block_bytes,
            });
        }
        let ids = pool.check_block_ids(block_ids)?;
        let _reading = self.enter();
        let (blocks, _in_flight) = self.begin_use(lease_id, first, ids.len())?;
        let Some(blocks) = blocks else {
            // A clear dropped the lease's blocks: every one misses, none is copied. Each layer
            // is still announced (as a load whose blocks all fail), so no layer waiter hangs.
            (0..pool.num_layers()).for_each(&mut *layer_done);
            let outcomes = vec![ReadOutcome::Missing; ids.len()];
            let checksum_failures = self.count_load(&outcomes, 0);
            return Ok(PoolLoadReport {
                loaded_blocks: 0,
                failed: (0..ids.len()).collect(),
                checksum_failures,
            });
        };
        let dram = self.tier_index(TierKind::Dram);
        let (in_dram, below): (Vec<usize>, Vec<usize>) =
            (0..ids.len()).partition(|&i| blocks[i].tier == dram);
        let mut outcomes = vec![ReadOutcome::NotPinned; ids.len()];

        // Lower tiers first (their reads are I/O): into staging objects, verified and decoded
        // (a reused buffer holds stale bytes; only blocks whose outcome is `Loaded` are used).
        let bb = self.block_bytes;
        let mut staged = self.staging.take(below.len() * bb);
        let below_blocks: Vec<_> = below.iter().map(|&i| blocks[i]).collect();
        let below_outcomes = {
            let mut dst: Vec<&mut [u8]> = staged.chunks_mut(bb).collect();
            self.read(&below_blocks, &mut dst, None)
        };
        let promoted: Vec<(_, &[u8])> = below_blocks
            .iter()
            .zip(staged.chunks(bb))
            .zip(&below_outcomes)
            .filter(|(_, &o)| o == ReadOutcome::Loaded)
            .map(|((b, d), _)| (*b, d))
            .collect();
        let (promote_blocks, promote_data): (Vec<_>, Vec<&[u8]>) = promoted.into_iter().unzip();
        let _ = self.promote(&promote_blocks, &promote_data);

        let entries: Vec<_> = in_dram.iter().map(|&i| blocks[i].entry).collect();
        let dram_ids: Vec<usize> = in_dram.iter().map(|&i| ids[i]).collect();
        let mut dram_outcomes = vec![ReadOutcome::NotPinned; in_dram.len()];
        self.hierarchy.dram.read_pinned_into_pool(
            self.namespace_hash,
            &entries,
            pool,
            &dram_ids,
            &mut dram_outcomes,
            &mut |layer| {
                for ((&i, object), &o) in below.iter().zip(staged.chunks(bb)).zip(&below_outcomes) {
                    if o == ReadOutcome::Loaded {
                        // SAFETY: ids were checked in range and distinct, the staged object is
                        // `block_bytes`, and the pool's builder promised exclusive access.
                        unsafe { pool.scatter_layer(object, ids[i], layer) };
                    }
                }
                copy::fence();
                layer_done(layer);
            },
        );
        for (&i, o) in in_dram.iter().zip(dram_outcomes).chain(below.iter().zip(below_outcomes)) {
            outcomes[i] = o;
        }
        self.hierarchy.hooks.at(HookPoint::LoadRead);
        let loaded_blocks = outcomes.iter().take_while(|&&o| o == ReadOutcome::Loaded).count();
        let checksum_failures = self.count_load(&outcomes, loaded_blocks);
        let failed = (0..outcomes.len()).filter(|&i| outcomes[i] != ReadOutcome::Loaded).collect();
        Ok(PoolLoadReport { loaded_blocks, failed, checksum_failures })
    }

    /// Stores pool block `block_ids[i]` under `keys[i]`, as [`put`](Self::put) stores objects
    /// (see the module docs for the copies). Ids may repeat. Errors, before anything is stored:
    /// the namespace, counts, the pool's object size, and an id out of range
    /// ([`StoreError::Layout`]). The caller must not write those pool blocks meanwhile. A
    /// [`clear`](Self::clear) waits for it, as for a put.
    pub fn put_from_pool(
        &self,
        namespace_hash: u128,
        keys: &[BlockKey],
        pool: &PagedPool,
        block_ids: &[u64],
    ) -> Result<PutReport, StoreError> {
        let _writing = self.enter();
        self.put_from_pool_entered(namespace_hash, keys, pool, block_ids)
    }

    /// [`put_from_pool`](Self::put_from_pool), once the caller holds the gate.
    pub(super) fn put_from_pool_entered(
        &self,
        namespace_hash: u128,
        keys: &[BlockKey],
        pool: &PagedPool,
        block_ids: &[u64],
    ) -> Result<PutReport, StoreError> {
        self.check_namespace(namespace_hash)?;
        if keys.len() != block_ids.len() {
            return Err(StoreError::CountMismatch { keys: keys.len(), objects: block_ids.len() });
        }
        if pool.block_bytes() != self.block_bytes {
            return Err(StoreError::ObjectSize {
                index: 0,
                actual: pool.block_bytes(),
                expected: self.block_bytes,
            });
        }
        let n = pool.num_blocks();
        let ids = block_ids
            .iter()
            .enumerate()
            .map(|(index, &id)| {
                usize::try_from(id).ok().filter(|&b| b < n).ok_or(LayoutError::BlockOutOfRange {
                    index,
                    block_id: id,
                    num_blocks: n as u64,
                })
            })
            .collect::<Result<Vec<usize>, _>>()?;
        if self.hierarchy.has_lower() {
            let bb = self.block_bytes;
            let mut staged = self.staging.take(ids.len() * bb);
            for (&b, object) in ids.iter().zip(staged.chunks_mut(bb)) {
                // SAFETY: `b` was checked in range; the caller does not write it meanwhile.
                unsafe { pool.gather_block(b, object) };
            }
            copy::fence();
            let objects: Vec<&[u8]> = staged.chunks(bb).collect();
            return self.put_entered(namespace_hash, keys, &objects);
        }
        self.reclaim_expired(&mut self.leases.lock());
        self.hierarchy.hooks.at(HookPoint::DramWrite);
        let report = self.hierarchy.dram.put_from_pool(self.namespace_hash, keys, pool, &ids);
        let writes = TierWrites { dram: report.stored, ..TierWrites::default() };
        Ok(self.count_put(HierarchyPut { report, writes }, keys.len()))
    }
}
