//! Moving blocks between DRAM and SSD: write-back demotion with an admission filter,
//! optional write-through, and promotion on hit.
//!
//! **Demotion (write-back).** A put first takes only DRAM's free space. For blocks that did not
//! fit, DRAM picks victims in eviction order and marks them *demoting* (still readable, not
//! evictable); those with at least `admission_k` accesses and not already in SSD are written
//! there straight from their DRAM extents (the payload starts each extent, page-aligned: O_DIRECT,
//! no copy); then they leave DRAM and the put
//! retries. A block leaves DRAM only after its SSD write finished, so it is never in neither
//! tier while a lookup could want it. Bounded: at most [`DEMOTION_ROUNDS_MAX`] rounds per put
//! (other threads may take the room freed); after that DRAM evicts without demoting, counted.
//!
//! **Promotion.** Blocks a load read from SSD are put into DRAM (with demotion as above), so
//! the next hit is a DRAM hit; the SSD copy stays (inclusive), so demoting it again later
//! writes nothing.

use kvtier_core::BlockKey;
use kvtier_pool::{object_extent_bytes, Demotion, Tier, TierKind, TierPutReport};

use crate::lease::LeasedBlock;
use crate::stats::bump;
use crate::store::Store;

/// Demote-and-retry rounds per put before DRAM evicts without demoting.
pub const DEMOTION_ROUNDS_MAX: usize = 4;

fn add(total: &mut TierPutReport, r: TierPutReport) {
    total.stored += r.stored;
    total.already_present += r.already_present;
    total.rejected += r.rejected;
    total.evicted += r.evicted;
}

impl Store {
    /// Puts a batch into DRAM, demoting what DRAM gives up to SSD (when there is one).
    pub(crate) fn put_hierarchy(&self, keys: &[BlockKey], objects: &[&[u8]]) -> TierPutReport {
        let ns = self.namespace_hash();
        let Some(ssd_config) = &self.config().ssd else { return self.dram.put(ns, keys, objects) };
        let mut total = TierPutReport::default();
        let mut refused = Vec::new();
        let mut r = self.dram.put_with(ns, keys, objects, false, &mut refused);
        r.rejected = 0; // refused items are retried below
        add(&mut total, r);
        let mut pending = refused;
        let object_bytes = object_extent_bytes(self.block_bytes() as u64);
        for _ in 0..DEMOTION_ROUNDS_MAX {
            if pending.is_empty() {
                break;
            }
            let demotion = self.dram.take_victims(pending.len() as u64 * object_bytes);
            if demotion.is_empty() {
                break;
            }
            total.evicted += demotion.victims().len();
            self.demote(&demotion, ssd_config.admission_k);
            demotion.finish();
            let (pk, po) = select(keys, objects, &pending);
            let mut refused = Vec::new();
            let mut r = self.dram.put_with(ns, &pk, &po, false, &mut refused);
            r.rejected = 0;
            add(&mut total, r);
            pending = refused.iter().map(|&j| pending[j]).collect();
        }
        if !pending.is_empty() {
            // Nothing left to demote (all leased), or other threads kept taking the room.
            let (pk, po) = select(keys, objects, &pending);
            let r = self.dram.put(ns, &pk, &po);
            bump(&self.counters.dropped_evictions, r.evicted);
            add(&mut total, r);
        }
        if ssd_config.write_through && ssd_config.admission_k <= 1 {
            let ssd = self.ssd.as_ref().expect("an ssd config opens an ssd tier");
            let r = ssd.put(ns, keys, objects);
            bump(&self.counters.written_through, r.stored);
        }
        total
    }

    /// Writes the admitted victims of `demotion` to SSD from their DRAM extents.
    fn demote(&self, demotion: &Demotion<'_>, admission_k: u32) {
        let ssd = self.ssd.as_ref().expect("demotion needs an ssd tier");
        let mut keys = Vec::new();
        let mut objects = Vec::new();
        for (i, v) in demotion.victims().iter().enumerate() {
            if v.accesses < admission_k {
                bump(&self.counters.admission_skipped, 1);
            } else if ssd.contains(v.key) {
                bump(&self.counters.demoted_blocks, 1);
            } else if let Some(checksum) = v.checksum {
                keys.push(v.key);
                objects.push((demotion.payload_pages(i), v.payload_len, checksum));
            } else {
                bump(&self.counters.demotion_failed, 1); // its DRAM header is corrupt: not spread
            }
        }
        if keys.is_empty() {
            return;
        }
        let r = ssd.put_pages(self.namespace_hash(), &keys, &objects);
        bump(&self.counters.demoted_blocks, r.stored + r.already_present);
        bump(&self.counters.demotion_failed, r.rejected);
    }

    /// Copies the blocks of a load that came from SSD into DRAM.
    pub(crate) fn promote(&self, blocks: &[LeasedBlock], dst: &[&mut [u8]]) {
        let Some(ssd_config) = &self.config().ssd else { return };
        if !ssd_config.promote_on_hit {
            return;
        }
        let ssd_tier = self.tier_index(TierKind::Ssd);
        let (keys, objects): (Vec<BlockKey>, Vec<&[u8]>) = blocks
            .iter()
            .zip(dst)
            .filter(|(b, _)| b.tier == ssd_tier)
            .map(|(b, d)| (b.entry.key, &**d))
            .unzip();
        if keys.is_empty() {
            return;
        }
        let r = self.put_hierarchy(&keys, &objects);
        bump(&self.counters.promoted_blocks, r.stored);
    }
}

fn select<'a>(keys: &[BlockKey], objects: &[&'a [u8]], items: &[usize]) -> (Vec<BlockKey>, Vec<&'a [u8]>) {
    (items.iter().map(|&i| keys[i]).collect(), items.iter().map(|&i| objects[i]).collect())
}
