//! Moving blocks between the tiers: DRAM → SSD (write-back demotion with an admission filter,
//! optional write-through) and → remote (write-through by default, or write-back), and
//! promotion on hit from either lower tier.
//!
//! **Demotion (write-back).** A put first takes only DRAM's free space. For blocks that did not
//! fit, DRAM picks victims in eviction order and marks them *demoting* (still readable, not
//! evictable); those with at least `admission_k` accesses and not already in SSD are written
//! there straight from their DRAM extents (the payload starts each extent, page-aligned: O_DIRECT,
//! no copy); with a write-back remote tier, every victim whose header verifies is also written
//! there (`SET NX`, from the same extent). Then they leave DRAM and the put retries. A block
//! leaves DRAM only after those writes finished, so it is never in no tier while a lookup could
//! want it. Bounded: at most [`DEMOTION_ROUNDS_MAX`] rounds per put (other threads may take the
//! room freed); after that DRAM evicts without demoting, counted.
//!
//! **Remote write-through** (the default): a put also writes to the remote tier the blocks DRAM
//! did not already hold, and those it held that the server lacks (one `EXISTS` batch: the
//! server may have restarted), so stores in other processes see them at once. A server that is
//! down skips the write (counted in `remote_write_failed`); the put itself still succeeds.
//!
//! **Promotion.** Blocks a load read from SSD or remote are put into DRAM (with demotion as
//! above, but never written back to remote: they came from there, or were written through
//! when first put), so the next hit is a DRAM hit; the lower copy stays (inclusive).

use std::sync::Arc;

use kvtier_core::BlockKey;
use kvtier_pool::{object_extent_bytes, Demotion, Tier, TierKind, TierPutReport};
use kvtier_remote::RemoteTier;

use crate::config::StoreConfig;
use crate::error::StoreError;
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

/// Opens the remote tier of `config` (if any). Bad settings and refused credentials are
/// [`StoreError::Config`]; a server that is not reachable yet is not an error (its blocks miss
/// until it is).
pub(crate) fn open_remote(
    config: &StoreConfig,
    namespace_hash: u128,
) -> Result<Option<Arc<RemoteTier>>, StoreError> {
    let Some(remote) = &config.remote else { return Ok(None) };
    let tier = RemoteTier::open(remote.client.clone(), namespace_hash)
        .map_err(|e| StoreError::Config(format!("remote: {e}")))?;
    Ok(Some(Arc::new(tier)))
}

impl Store {
    fn remote_write_back(&self) -> bool {
        self.config().remote.as_ref().is_some_and(|r| !r.write_through)
    }

    /// Puts a batch into the hierarchy: DRAM (demoting what it gives up), then, with a
    /// write-through remote tier, the remote copy of the blocks DRAM did not already hold.
    pub(crate) fn put_hierarchy(&self, keys: &[BlockKey], objects: &[&[u8]]) -> TierPutReport {
        let through = match (&self.remote, &self.config().remote) {
            (Some(remote), Some(rc)) if rc.write_through => Some(remote),
            _ => None,
        };
        let fresh: Vec<usize> = match through {
            Some(remote) => self.missing_remotely(remote, keys),
            None => Vec::new(),
        };
        let report = self.put_local(keys, objects);
        if let Some(remote) = through {
            if !fresh.is_empty() {
                let (fk, fo) = select(keys, objects, &fresh);
                let r = remote.put(self.namespace_hash(), &fk, &fo);
                bump(&self.counters.remote_written, r.stored + r.already_present);
                bump(&self.counters.remote_write_failed, r.rejected);
            }
        }
        report
    }

    /// Which of `keys` a write-through put must send: those DRAM does not hold (never written
    /// through, or evicted since), and those DRAM holds but the server lacks (it restarted, or
    /// dropped them) — found with one pipelined `EXISTS` batch, so a repeated put of a cached
    /// prompt sends no values.
    fn missing_remotely(&self, remote: &RemoteTier, keys: &[BlockKey]) -> Vec<usize> {
        let (mut fresh, held): (Vec<usize>, Vec<usize>) =
            (0..keys.len()).partition(|&i| !self.dram.contains(keys[i]));
        if !held.is_empty() {
            let held_keys: Vec<BlockKey> = held.iter().map(|&i| keys[i]).collect();
            let present = remote.exists(self.namespace_hash(), &held_keys);
            fresh.extend(held.iter().zip(present).filter(|(_, p)| *p == Some(false)).map(|(&i, _)| i));
            fresh.sort_unstable();
        }
        fresh
    }

    /// Puts a batch into DRAM, demoting what DRAM gives up to SSD and/or a write-back remote.
    fn put_local(&self, keys: &[BlockKey], objects: &[&[u8]]) -> TierPutReport {
        let ns = self.namespace_hash();
        if self.ssd.is_none() && !self.remote_write_back() {
            return self.dram.put(ns, keys, objects);
        }
        let admission_k = self.config().ssd.as_ref().map_or(1, |s| s.admission_k);
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
            self.demote(&demotion, admission_k);
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
        if let (Some(ssd), Some(ssd_config)) = (&self.ssd, &self.config().ssd) {
            if ssd_config.write_through && ssd_config.admission_k <= 1 {
                let r = ssd.put(ns, keys, objects);
                bump(&self.counters.written_through, r.stored);
            }
        }
        total
    }

    /// Writes the victims of `demotion` to SSD (admitted ones) and to a write-back remote tier
    /// (all whose DRAM header verifies), from their DRAM extents.
    fn demote(&self, demotion: &Demotion<'_>, admission_k: u32) {
        if self.remote_write_back() {
            self.demote_remote(demotion);
        }
        let Some(ssd) = self.ssd.as_ref() else { return };
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

    fn demote_remote(&self, demotion: &Demotion<'_>) {
        let remote = self.remote.as_ref().expect("a remote config opens a remote tier");
        let (mut keys, mut payloads, mut checksums) = (Vec::new(), Vec::new(), Vec::new());
        for (i, v) in demotion.victims().iter().enumerate() {
            if let Some(checksum) = v.checksum {
                keys.push(v.key);
                payloads.push(&demotion.payload_pages(i)[..v.payload_len as usize]);
                checksums.push(checksum);
            }
        }
        if keys.is_empty() {
            return;
        }
        let r = remote.put_with_checksums(self.namespace_hash(), &keys, &payloads, &checksums);
        bump(&self.counters.remote_written, r.stored + r.already_present);
        bump(&self.counters.remote_write_failed, r.rejected);
    }

    /// Copies the blocks of a load that came from SSD or remote into DRAM.
    pub(crate) fn promote(&self, blocks: &[LeasedBlock], dst: &[&mut [u8]]) {
        let mut from = Vec::new();
        if self.config().ssd.as_ref().is_some_and(|s| s.promote_on_hit) {
            from.push(self.tier_index(TierKind::Ssd));
        }
        if self.config().remote.as_ref().is_some_and(|r| r.promote_on_hit) {
            from.push(self.tier_index(TierKind::Remote));
        }
        if from.is_empty() {
            return;
        }
        let (keys, objects): (Vec<BlockKey>, Vec<&[u8]>) = blocks
            .iter()
            .zip(dst)
            .filter(|(b, _)| from.contains(&b.tier))
            .map(|(b, d)| (b.entry.key, &**d))
            .unzip();
        if keys.is_empty() {
            return;
        }
        let r = self.put_local(&keys, &objects);
        bump(&self.counters.promoted_blocks, r.stored);
    }
}

fn select<'a>(keys: &[BlockKey], objects: &[&'a [u8]], items: &[usize]) -> (Vec<BlockKey>, Vec<&'a [u8]>) {
    (items.iter().map(|&i| keys[i]).collect(), items.iter().map(|&i| objects[i]).collect())
}
