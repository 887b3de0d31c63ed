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
//! **SSD write-through** (`ssd.write_through`): after the DRAM put, the blocks DRAM now holds are
//! written to SSD from their pinned DRAM extents (as demotion does: O_DIRECT, no staging copy,
//! the DRAM header's checksum), the rest from the caller's buffers.
//!
//! **Remote write-through** (the default): a put also writes to the remote tier the blocks DRAM
//! did not already hold, and those it held that the server lacks (one `EXISTS` batch: the
//! server may have restarted), so stores in other processes see them at once. A server that is
//! down skips the write (counted in `remote_write_failed`); the put itself still succeeds.
//!
//! **Promotion.** Blocks a load read from SSD or remote are put into DRAM (with demotion as
//! above, but never written back to remote: they came from there, or were written through
//! when first put), so the next hit is a DRAM hit; the lower copy stays (inclusive).
//!
//! **Codecs** (`ssd.codec`, `remote.codec`): each lower level ([`crate::levels`]) owns the form
//! of its bytes — it encodes what this policy writes to it and decodes what a load reads from
//! it. Promotion puts the decoded block into DRAM, which holds raw blocks only.
//!
//! This module is policy only: which blocks move where, and when. It holds DRAM (whose victims
//! it picks) and the lower levels it writes to; the store reads through [`crate::levels::Level`].

use std::sync::Arc;

use kvtier_core::BlockKey;
use kvtier_pool::{object_extent_bytes, Demotion, DramTier, Tier, TierKind, TierPutReport};

use crate::config::StoreConfig;
use crate::hooks::{HookPoint, Hooks};
use crate::levels::remote::RemoteLevel;
use crate::levels::ssd::SsdLevel;
use crate::levels::{select, ExtentPayload};
use crate::stats::{bump, Counters};
use crate::types::{HierarchyPut, TierWrites};

/// A put into DRAM and SSD: the report, writes, and the items no local tier holds.
struct LocalPut {
    report: TierPutReport,
    writes: TierWrites,
    unplaced: Vec<usize>,
}

/// Demote-and-retry rounds per put before DRAM evicts without demoting.
pub const DEMOTION_ROUNDS_MAX: usize = 4;

fn add(total: &mut TierPutReport, r: TierPutReport) {
    total.stored += r.stored;
    total.already_present += r.already_present;
    total.rejected += r.rejected;
    total.evicted += r.evicted;
}

/// The settings of [`StoreConfig`] that decide where blocks move.
#[derive(Clone, Copy, Debug)]
struct Policy {
    /// Accesses a DRAM victim needs before it is demoted to SSD.
    admission_k: u32,
    /// Puts also write to SSD (only with `admission_k <= 1`).
    ssd_write_through: bool,
    /// Puts also write to the remote tier (else DRAM's victims are written there).
    remote_write_through: bool,
    ssd_promotes: bool,
    remote_promotes: bool,
}

/// Demotion and promotion between DRAM and the lower levels of one store's namespace.
pub(crate) struct Hierarchy {
    namespace_hash: u128,
    block_bytes: usize,
    pub dram: Arc<DramTier>,
    pub ssd: Option<Arc<SsdLevel>>,
    pub remote: Option<Arc<RemoteLevel>>,
    policy: Policy,
    /// Pause points for tests (empty without `test-hooks`).
    pub hooks: Hooks,
}

impl Hierarchy {
    pub(crate) fn new(
        config: &StoreConfig,
        namespace_hash: u128,
        block_bytes: usize,
        dram: Arc<DramTier>,
        ssd: Option<Arc<SsdLevel>>,
        remote: Option<Arc<RemoteLevel>>,
    ) -> Hierarchy {
        let policy = Policy {
            admission_k: config.ssd.as_ref().map_or(1, |s| s.admission_k),
            ssd_write_through: config.ssd.as_ref().is_some_and(|s| s.write_through && s.admission_k <= 1),
            remote_write_through: config.remote.as_ref().is_some_and(|r| r.write_through),
            ssd_promotes: config.ssd.as_ref().is_some_and(|s| s.promote_on_hit),
            remote_promotes: config.remote.as_ref().is_some_and(|r| r.promote_on_hit),
        };
        Hierarchy { namespace_hash, block_bytes, dram, ssd, remote, policy, hooks: Hooks::default() }
    }

    /// Whether blocks loaded from a tier of `kind` are promoted into DRAM (`promote_on_hit`).
    pub(crate) fn promotes_from(&self, kind: TierKind) -> bool {
        match kind {
            TierKind::Ssd => self.policy.ssd_promotes,
            TierKind::Remote => self.policy.remote_promotes,
            _ => false,
        }
    }

    /// Whether any tier sits below DRAM.
    pub(crate) fn has_lower(&self) -> bool {
        self.ssd.is_some() || self.remote.is_some()
    }

    /// The remote level when DRAM's victims are written to it (write-back).
    fn remote_write_back(&self) -> Option<&RemoteLevel> {
        self.remote.as_deref().filter(|_| !self.policy.remote_write_through)
    }

    /// Puts a batch into the hierarchy: DRAM (demoting what it gives up), then, with a
    /// write-through remote tier, the remote copy of the blocks DRAM did not already hold.
    pub(crate) fn put(&self, c: &Counters, keys: &[BlockKey], objects: &[&[u8]]) -> HierarchyPut {
        let through = self.remote.as_deref().filter(|_| self.policy.remote_write_through);
        let fresh: Vec<usize> = match through {
            Some(remote) => self.missing_remotely(remote, keys),
            None => Vec::new(),
        };
        let LocalPut { mut report, mut writes, unplaced } = self.put_local(c, keys, objects);
        if let Some(remote) = through {
            if !fresh.is_empty() {
                self.hooks.at(HookPoint::RemoteWrite);
                let (fk, fo) = select(keys, objects, &fresh);
                writes.remote += remote.put(self.namespace_hash, &fk, &fo, None, c).stored;
            }
            if !unplaced.is_empty() {
                // DRAM had no room for these: they are stored if the server holds them now (one
                // EXISTS batch, only when a put overflowed every local tier).
                let uk: Vec<BlockKey> = unplaced.iter().map(|&i| keys[i]).collect();
                let held =
                    remote.tier.exists(self.namespace_hash, &uk).iter().filter(|p| **p == Some(true)).count();
                report.rejected -= held;
                report.stored += held;
            }
        }
        HierarchyPut { report, writes }
    }

    /// Which of `keys` a write-through put must send: those DRAM does not hold (never written
    /// through, or evicted since), and those DRAM holds but the server lacks (it restarted, or
    /// dropped them) — found with one pipelined `EXISTS` batch, so a repeated put of a cached
    /// prompt sends no values.
    fn missing_remotely(&self, remote: &RemoteLevel, keys: &[BlockKey]) -> Vec<usize> {
        let (mut fresh, held): (Vec<usize>, Vec<usize>) =
            (0..keys.len()).partition(|&i| !self.dram.contains(self.namespace_hash, keys[i]));
        if !held.is_empty() {
            let held_keys: Vec<BlockKey> = held.iter().map(|&i| keys[i]).collect();
            let present = remote.tier.exists(self.namespace_hash, &held_keys);
            fresh.extend(held.iter().zip(present).filter(|(_, p)| *p == Some(false)).map(|(&i, _)| i));
            fresh.sort_unstable();
        }
        fresh
    }

    /// Puts a batch into DRAM, demoting what DRAM gives up to SSD and/or a write-back remote.
    fn put_local(&self, c: &Counters, keys: &[BlockKey], objects: &[&[u8]]) -> LocalPut {
        let ns = self.namespace_hash;
        self.hooks.at(HookPoint::DramWrite);
        if self.ssd.is_none() && self.remote_write_back().is_none() {
            let mut unplaced = Vec::new();
            let report = self.dram.put_with(ns, keys, objects, true, &mut unplaced);
            let writes = TierWrites { dram: report.stored, ..TierWrites::default() };
            return LocalPut { report, writes, unplaced };
        }
        let mut writes = TierWrites::default();
        let mut total = TierPutReport::default();
        let mut refused = Vec::new();
        let mut r = self.dram.put_with(ns, keys, objects, false, &mut refused);
        r.rejected -= refused.len(); // refused items are retried below (the rest: other namespaces)
        writes.dram += r.stored;
        add(&mut total, r);
        let mut pending = refused;
        let object_bytes = object_extent_bytes(self.block_bytes as u64);
        for _ in 0..DEMOTION_ROUNDS_MAX {
            if pending.is_empty() {
                break;
            }
            let demotion = self.dram.take_victims(pending.len() as u64 * object_bytes);
            if demotion.is_empty() {
                break;
            }
            total.evicted += demotion.victims().len();
            writes.ssd += self.demote(c, &demotion);
            demotion.finish();
            let (pk, po) = select(keys, objects, &pending);
            let mut refused = Vec::new();
            let mut r = self.dram.put_with(ns, &pk, &po, false, &mut refused);
            r.rejected -= refused.len();
            writes.dram += r.stored;
            add(&mut total, r);
            pending = refused.iter().map(|&j| pending[j]).collect();
        }
        if !pending.is_empty() {
            // Nothing left to demote (all leased), or other threads kept taking the room.
            let (pk, po) = select(keys, objects, &pending);
            let mut refused = Vec::new();
            let r = self.dram.put_with(ns, &pk, &po, true, &mut refused);
            bump(&c.dropped_evictions, r.evicted);
            writes.dram += r.stored;
            add(&mut total, r);
            pending = refused.iter().map(|&j| pending[j]).collect();
        }
        if let Some(ssd) = &self.ssd {
            // Blocks DRAM had no room for that SSD held before this put (already present there).
            let on_ssd_before: Vec<bool> = pending.iter().map(|&i| ssd.tier.contains(ns, keys[i])).collect();
            if self.policy.ssd_write_through {
                let r = self.write_through(c, ssd, keys, objects);
                bump(&c.written_through, r.stored);
                writes.ssd += r.stored;
            }
            // A block SSD holds is not refused, whichever tier DRAM's lack of room sent it to.
            let mut unplaced = Vec::with_capacity(pending.len());
            for (&i, before) in pending.iter().zip(on_ssd_before) {
                if before {
                    total.rejected -= 1;
                    total.already_present += 1;
                } else if ssd.tier.contains(ns, keys[i]) {
                    total.rejected -= 1;
                    total.stored += 1;
                } else {
                    unplaced.push(i);
                }
            }
            pending = unplaced;
        }
        LocalPut { report: total, writes, unplaced: pending }
    }

    /// Writes `keys` to SSD (write-through): the copies DRAM holds now straight from their
    /// pinned DRAM pages (page-aligned: O_DIRECT without a staging copy, the checksum from the
    /// DRAM header instead of a second pass; through a codec each is first checked against that
    /// checksum), the others (DRAM had no room) from the caller's `objects`.
    fn write_through(
        &self,
        c: &Counters,
        ssd: &SsdLevel,
        keys: &[BlockKey],
        objects: &[&[u8]],
    ) -> TierPutReport {
        let ns = self.namespace_hash;
        self.hooks.at(HookPoint::SsdWrite);
        let mut from_dram = vec![false; keys.len()];
        let mut total = TierPutReport::default();
        {
            let pinned = self.dram.pin_pages(ns, keys);
            let (mut pk, mut pe): (Vec<BlockKey>, Vec<ExtentPayload<'_>>) = (Vec::new(), Vec::new());
            for (i, p) in pinned.pages().iter().enumerate() {
                if let Some(sum) = p.checksum.filter(|_| p.payload_len == objects[p.item].len() as u64) {
                    from_dram[p.item] = true;
                    pk.push(keys[p.item]);
                    pe.push((pinned.payload_pages(i), p.payload_len, sum));
                }
            }
            if !pk.is_empty() {
                add(&mut total, ssd.put_extents(ns, &pk, &pe, c));
            }
        }
        let rest: Vec<usize> = (0..keys.len()).filter(|&i| !from_dram[i]).collect();
        if !rest.is_empty() {
            let (rk, ro) = select(keys, objects, &rest);
            add(&mut total, ssd.put(ns, &rk, &ro, c));
        }
        total
    }

    /// Writes the victims of `demotion` to SSD (admitted ones) and to a write-back remote tier
    /// (all whose DRAM header verifies), straight from their DRAM extents; returns the SSD writes.
    fn demote(&self, c: &Counters, demotion: &Demotion<'_>) -> usize {
        let ns = self.namespace_hash;
        if let Some(remote) = self.remote_write_back() {
            let (mut keys, mut extents) = (Vec::new(), Vec::new());
            for (i, v) in demotion.victims().iter().enumerate() {
                if let Some(checksum) = v.checksum {
                    keys.push(v.key);
                    extents.push((demotion.payload_pages(i), v.payload_len, checksum));
                }
            }
            if !keys.is_empty() {
                self.hooks.at(HookPoint::RemoteWrite);
                remote.put_extents(ns, &keys, &extents, c);
            }
        }
        let Some(ssd) = self.ssd.as_ref() else { return 0 };
        let mut keys = Vec::new();
        let mut extents: Vec<ExtentPayload<'_>> = Vec::new();
        for (i, v) in demotion.victims().iter().enumerate() {
            if v.accesses < self.policy.admission_k {
                bump(&c.admission_skipped, 1);
            } else if ssd.tier.contains(ns, v.key) {
                bump(&c.demoted_blocks, 1);
            } else if let Some(checksum) = v.checksum {
                keys.push(v.key);
                extents.push((demotion.payload_pages(i), v.payload_len, checksum));
            } else {
                bump(&c.demotion_failed, 1); // its DRAM header is corrupt: not spread
            }
        }
        if keys.is_empty() {
            return 0;
        }
        self.hooks.at(HookPoint::SsdWrite);
        let r = ssd.put_extents(ns, &keys, &extents, c);
        bump(&c.demoted_blocks, r.stored + r.already_present);
        bump(&c.demotion_failed, r.rejected);
        r.stored
    }

    /// Puts blocks a load read from a lower tier that promotes on hit into DRAM (`keys[i]`'s
    /// decoded block is `objects[i]`); returns how many were stored.
    pub(crate) fn promote(&self, c: &Counters, keys: &[BlockKey], objects: &[&[u8]]) -> usize {
        if keys.is_empty() {
            return 0;
        }
        let r = self.put_local(c, keys, objects).report;
        bump(&c.promoted_blocks, r.stored);
        r.stored
    }
}
