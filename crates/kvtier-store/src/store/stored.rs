//! Loads that hand blocks out as their tier stores them ([`Store::load_range_stored`]), and the
//! calls with which such a reader reports back: blocks it could not decode
//! ([`Store::report_undecodable`]) and decoded blocks to promote ([`Store::promote_decoded`]).

use kvtier_pool::{EntryRef, ReadOutcome};

use super::Store;
use crate::error::StoreError;
use crate::lease::LeasedBlock;
use crate::stats::bump;
use crate::types::{StoredBlock, StoredLoadReport};

impl Store {
    /// Like [`load_range`](Self::load_range), but each block is copied into its destination
    /// (`block_bytes` each) *as its tier stores it*, verified and not decoded: a DRAM block or a
    /// raw lower-tier block is the block; an SSD or remote codec object (`ssd_codec`,
    /// `remote_codec`) is its codec payload, read in place, so a reader moves the encoded bytes
    /// only and decodes them itself by the codec id reported per block ([`StoredBlock`]). The
    /// same checks as a load run first (pool checksum; object header, namespace, key, payload
    /// checksum; a known codec id declaring `block_bytes`); a block failing them is `None`,
    /// dropped from its tier and counted, and the other blocks are still read. Blocks read
    /// from lower tiers are not promoted here (the store never sees them decoded): the reader
    /// hands them back decoded with [`promote_decoded`](Self::promote_decoded), and reports
    /// blocks it cannot decode with [`report_undecodable`](Self::report_undecodable).
    pub fn load_range_stored(
        &self,
        lease_id: u64,
        first: usize,
        dst: &mut [&mut [u8]],
    ) -> Result<StoredLoadReport, StoreError> {
        let _reading = self.enter();
        let (blocks, _in_flight) = self.begin_load(lease_id, first, dst)?;
        let mut forms = vec![StoredBlock::raw(self.block_bytes); dst.len()];
        let outcomes = match blocks {
            Some(blocks) => self.read(&blocks, dst, Some(&mut forms)),
            None => vec![ReadOutcome::Missing; dst.len()], // a clear dropped them
        };
        let loaded = outcomes.iter().filter(|&&o| o == ReadOutcome::Loaded).count();
        let checksum_failures = self.count_load(&outcomes, loaded);
        let blocks =
            outcomes.iter().zip(forms).map(|(&o, f)| (o == ReadOutcome::Loaded).then_some(f)).collect();
        Ok(StoredLoadReport { blocks, checksum_failures })
    }

    /// The reader of a [`load_range_stored`](Self::load_range_stored) on lease `lease_id` could
    /// not decode leased blocks `leased` (positions in the lease) although their stored bytes
    /// verified: each is counted in `decode_failures` and its stored copy is dropped from its
    /// tier (a pinned copy is freed on its last unpin), so no later load hands it out again —
    /// the same handling as the store's own decoding path. Returns how many copies were
    /// dropped; a position listed twice counts once. Errors as a load on a lease that is not
    /// live, or with a position past the lease's blocks ([`StoreError::LoadTooMany`]). Like a
    /// load, the call keeps the lease from being reclaimed while it runs.
    pub fn report_undecodable(&self, lease_id: u64, leased: &[usize]) -> Result<usize, StoreError> {
        let mut leased = leased.to_vec();
        leased.sort_unstable();
        leased.dedup();
        let (Some(&first), Some(&last)) = (leased.first(), leased.last()) else { return Ok(0) };
        // As a load: the lease cannot be reclaimed (and its copies unpinned) meanwhile.
        let _reading = self.enter();
        let (blocks, _in_flight) = self.begin_use(lease_id, first, (last - first).saturating_add(1))?;
        let Some(blocks) = blocks else { return Ok(0) }; // a clear dropped them already
        bump(&self.counters.decode_failures, leased.len());
        let mut dropped = 0;
        for (t, tier) in self.tiers().enumerate() {
            // The leased copies themselves: a copy of the key stored since is not the one that
            // failed.
            let entries: Vec<EntryRef> =
                leased.iter().map(|&i| blocks[i - first]).filter(|b| b.tier == t).map(|b| b.entry).collect();
            if !entries.is_empty() {
                dropped += tier.remove_entries(self.namespace_hash, &entries);
            }
        }
        Ok(dropped)
    }

    /// Whether a load promotes blocks read from a lower tier into DRAM (`promote_on_hit` of the
    /// SSD or remote tier): a reader of stored bytes then hands them back decoded with
    /// [`promote_decoded`](Self::promote_decoded).
    pub fn promotes_on_hit(&self) -> bool {
        let ssd = self.config.ssd.as_ref().is_some_and(|s| s.promote_on_hit);
        ssd || self.config.remote.as_ref().is_some_and(|r| r.promote_on_hit)
    }

    /// Promotion for [`load_range_stored`](Self::load_range_stored), which never sees blocks
    /// decoded: `decoded[i]` is leased block `first + i` as its reader decoded it (exactly
    /// `block_bytes`), or `None` (not loaded). Blocks that came from a tier with
    /// `promote_on_hit` are put into DRAM, as [`load_range`](Self::load_range) does; the rest
    /// are ignored. Returns the blocks promoted. Errors as
    /// [`report_undecodable`](Self::report_undecodable), or on a block of the wrong size (its
    /// index in `decoded`).
    pub fn promote_decoded(
        &self,
        lease_id: u64,
        first: usize,
        decoded: &[Option<&[u8]>],
    ) -> Result<usize, StoreError> {
        for (index, d) in decoded.iter().enumerate() {
            if let Some(d) = d.filter(|d| d.len() != self.block_bytes) {
                return Err(StoreError::ObjectSize { index, actual: d.len(), expected: self.block_bytes });
            }
        }
        let _writing = self.enter();
        let (blocks, _in_flight) = self.begin_use(lease_id, first, decoded.len())?;
        // A clear since the lease: what its reader decoded is from before the clear.
        let Some(blocks) = blocks.filter(|_| self.promotes_on_hit()) else { return Ok(0) };
        let (chosen, data): (Vec<LeasedBlock>, Vec<&[u8]>) =
            blocks.iter().zip(decoded).filter_map(|(b, d)| d.map(|d| (*b, d))).unzip();
        Ok(self.promote(&chosen, &data))
    }
}
