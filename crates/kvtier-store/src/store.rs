//! [`Store`]: the tier hierarchy behind one namespace, with leases. The store reads, locates,
//! pins and checks its tiers through [`Level`] trait objects only, fastest first; where blocks
//! move between tiers (demotion, write-through, promotion) is [`Hierarchy`]'s policy.
//!
//! Submodules extend [`Store`]: `pool.rs` (an engine's paged pool), `stored.rs` (loads of
//! stored, undecoded bytes), `inspect.rs` (stats, metrics, integrity), `lookup.rs` (where keys
//! are, nothing pinned), `leasing.rs` (granting a lease), `staging.rs`, `clear.rs` (clearing the
//! namespace, and the gate every write and load passes that makes a clear a barrier).

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

use kvtier_core::parallel::WorkerPool;
use kvtier_core::{BlockKey, Namespace};
use kvtier_pool::{eviction_by_name, object_extent_bytes, DramTier, EntryRef, Located, ReadOutcome, Tier};
use kvtier_pool::{TierKind, PAGE_BYTES};
use parking_lot::{Mutex, RwLock};

use crate::codec_stage::TierEncoder;
use crate::config::{StoreConfig, TierCodec};
use crate::error::StoreError;
use crate::hierarchy::Hierarchy;
use crate::hooks::HookPoint;
use crate::lease::{LeaseTable, LeasedBlock};
use crate::levels::remote::RemoteLevel;
use crate::levels::ssd::SsdLevel;
use crate::levels::{Level, RawLevel};
use crate::stats::{bump, Counters};
use crate::types::{HierarchyPut, LoadReport, PutReport, StoredBlock};

/// The smallest chunk a promoting load reads while the chunk before it is promoted
/// ([`Store::read_promoting`]): 8 blocks of 2 MiB, the SSD worker's default depth.
const PROMOTE_CHUNK_MIN_BYTES: usize = 16 << 20;

mod clear;
mod inspect;
mod leasing;
mod lookup;
mod pool;
mod staging;
mod stored;

/// A hierarchical KV-cache store for one [`Namespace`]. `Send + Sync`; share it by reference
/// or `Arc` between threads.
pub struct Store {
    namespace: Namespace,
    namespace_hash: u128,
    block_bytes: usize,
    config: StoreConfig,
    /// The hierarchy, fastest first; at most one tier of each kind. Each level owns the form
    /// of its bytes (its codec).
    levels: Vec<Arc<dyn Level>>,
    /// Demotion and promotion policy, with the levels it moves blocks between.
    hierarchy: Hierarchy,
    /// Held for reading by every call that writes a tier or reads block bytes, for its whole
    /// duration, and for writing by [`clear`](Self::clear): see `clear.rs`. Lock order: `gate`,
    /// `leases`, then a tier's lock.
    gate: RwLock<()>,
    /// Clears begun so far ([`epoch`](Self::epoch)); changes only under `gate` held for writing.
    epoch: AtomicU64,
    /// The leases. A lease's pins are taken before it is granted, without this lock
    /// (`leasing.rs`); they are dropped under it.
    leases: Mutex<LeaseTable>,
    pub(crate) counters: Counters,
    /// Reused buffers for whole objects between an engine pool and the lower tiers.
    staging: staging::Staging,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tiers: Vec<&str> = self.tiers().map(|t| t.kind().name()).collect();
        f.debug_struct("Store")
            .field("namespace", &self.namespace)
            .field("block_bytes", &self.block_bytes)
            .field("config", &self.config)
            .field("tiers", &tiers)
            .finish()
    }
}

impl Store {
    /// A store with a DRAM tier of `config.dram.capacity_bytes` and, with `config.ssd`, an SSD
    /// pool below it (opened, and recovered from its index log, here).
    pub fn new(namespace: Namespace, config: StoreConfig) -> Result<Store, StoreError> {
        config.validate()?;
        let namespace_hash = namespace.hash().map_err(|e| StoreError::Config(format!("namespace: {e}")))?;
        let block_bytes = usize::try_from(namespace.geometry.block_bytes())
            .map_err(|_| StoreError::Config("block_bytes does not fit this machine's usize".into()))?;
        let object_bytes = object_extent_bytes(block_bytes as u64);
        let usable = config.dram.capacity_bytes / PAGE_BYTES * PAGE_BYTES;
        if usable < object_bytes {
            return Err(StoreError::Config(format!(
                "dram.capacity_bytes is {} and holds no block; expected at least {object_bytes} \
                 (64-byte header + {block_bytes}-byte block, rounded up to {PAGE_BYTES}-byte pages)",
                config.dram.capacity_bytes
            )));
        }
        let geometry = &namespace.geometry;
        let ssd_codec = config.ssd.as_ref().map_or(TierCodec::Raw, |s| s.codec.clone());
        let remote_codec = config.remote.as_ref().map_or(TierCodec::Raw, |r| r.codec.clone());
        let ssd_encoder = TierEncoder::new(&ssd_codec, "ssd", geometry)?;
        let remote_encoder = TierEncoder::new(&remote_codec, "remote", geometry)?;
        let policy = eviction_by_name(&config.eviction).map_err(|e| StoreError::Config(e.to_string()))?;
        let workers = Arc::new(WorkerPool::new(config.copy_threads));
        let dram = DramTier::new(config.dram.capacity_bytes, policy, workers)?;
        if config.dram.prefault {
            // A failed prefault only means pages fault in on first use, as without it.
            let _ = dram.prefault();
        }
        let dram = Arc::new(dram);
        let mut levels: Vec<Arc<dyn Level>> = vec![Arc::new(RawLevel(dram.clone()))];
        let ssd = match &config.ssd {
            None => None,
            Some(c) => Some(Arc::new(SsdLevel::open(c, &config.eviction, block_bytes, ssd_encoder)?)),
        };
        if let Some(ssd) = &ssd {
            levels.push(ssd.clone());
        }
        let remote = RemoteLevel::open(&config, namespace_hash, block_bytes, remote_encoder)?.map(Arc::new);
        if let Some(remote) = &remote {
            levels.push(remote.clone());
        }
        let hierarchy = Hierarchy::new(&config, namespace_hash, block_bytes, dram, ssd, remote);
        let leases = Mutex::new(LeaseTable::new(config.lease_ttl, config.leases_max));
        Ok(Store {
            namespace,
            namespace_hash,
            block_bytes,
            config,
            levels,
            hierarchy,
            gate: RwLock::new(()),
            epoch: AtomicU64::new(0),
            leases,
            counters: Counters::default(),
            staging: staging::Staging::default(),
        })
    }

    pub fn namespace(&self) -> &Namespace {
        &self.namespace
    }
    pub fn namespace_hash(&self) -> u128 {
        self.namespace_hash
    }
    /// Payload bytes of every block of this namespace.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }
    pub fn config(&self) -> &StoreConfig {
        &self.config
    }
    /// Kinds of the tiers in the hierarchy, fastest first.
    pub fn tier_kinds(&self) -> Vec<TierKind> {
        self.tiers().map(|t| t.kind()).collect()
    }

    /// The tiers, fastest first (as trait objects; indices are [`LeasedBlock::tier`]).
    fn tiers(&self) -> impl Iterator<Item = &dyn Tier> + '_ {
        self.levels.iter().map(|l| l.tier())
    }

    fn check_namespace(&self, namespace_hash: u128) -> Result<(), StoreError> {
        if namespace_hash != self.namespace_hash {
            return Err(StoreError::NamespaceMismatch {
                found: namespace_hash,
                expected: self.namespace_hash,
            });
        }
        Ok(())
    }

    fn check_sizes(&self, buffers: impl Iterator<Item = usize>) -> Result<(), StoreError> {
        for (index, actual) in buffers.enumerate() {
            if actual != self.block_bytes {
                return Err(StoreError::ObjectSize { index, actual, expected: self.block_bytes });
            }
        }
        Ok(())
    }

    pub(crate) fn tier_index(&self, kind: TierKind) -> usize {
        self.tiers().position(|t| t.kind() == kind).expect("located in a tier of this store")
    }

    /// Stores `objects[i]` (the BlockFirst payload of `keys[i]`, exactly `block_bytes`) in the
    /// fastest tier. Keys already present are skipped; when every block that could make room
    /// is leased, the rest are rejected (capacity is never exceeded). With an SSD tier, blocks
    /// DRAM gives up for room are first written to SSD (write-back, after the admission filter).
    /// A [`clear`](Self::clear) waits for a put in flight; a put called during a clear waits
    /// for it and lands after it.
    pub fn put(
        &self,
        namespace_hash: u128,
        keys: &[BlockKey],
        objects: &[&[u8]],
    ) -> Result<PutReport, StoreError> {
        let _writing = self.enter();
        self.put_entered(namespace_hash, keys, objects)
    }

    /// [`put`](Self::put), once the caller holds the gate.
    fn put_entered(
        &self,
        namespace_hash: u128,
        keys: &[BlockKey],
        objects: &[&[u8]],
    ) -> Result<PutReport, StoreError> {
        self.check_namespace(namespace_hash)?;
        if keys.len() != objects.len() {
            return Err(StoreError::CountMismatch { keys: keys.len(), objects: objects.len() });
        }
        self.check_sizes(objects.iter().map(|o| o.len()))?;
        // Expired leases pin space a put may need; reclaiming is O(1) when none expired.
        self.reclaim_expired(&mut self.leases.lock());
        let put = self.hierarchy.put(&self.counters, keys, objects);
        Ok(self.count_put(put, keys.len()))
    }

    /// Counts a put of `keys` blocks in the store's stats.
    fn count_put(&self, put: HierarchyPut, keys: usize) -> PutReport {
        let report = put.report;
        assert_eq!(report.stored + report.already_present + report.rejected, keys, "put lost keys");
        bump(&self.counters.put_blocks, report.stored);
        bump(&self.counters.put_bytes, report.stored * self.block_bytes);
        bump(&self.counters.evictions, report.evicted);
        bump(&self.counters.rejected_puts, report.rejected);
        PutReport {
            stored: report.stored,
            already_present: report.already_present,
            rejected: report.rejected,
            evicted: report.evicted,
            written: put.writes,
        }
    }

    /// Locates `keys` across the hierarchy; returns the hit prefix length. With `pin`, the
    /// prefix is pinned and nothing else stays pinned.
    fn locate(&self, keys: &[BlockKey], located: &mut [Option<Located>], pin: bool) -> usize {
        let last = self.levels.len() - 1;
        for (i, tier) in self.tiers().enumerate() {
            tier.locate(self.namespace_hash, keys, located, pin, i == last);
        }
        let hit = located.iter().take_while(|l| l.is_some()).count();
        if pin && hit < keys.len() {
            let beyond: Vec<LeasedBlock> = located[hit..]
                .iter()
                .flatten()
                .map(|l| LeasedBlock { tier: self.tier_index(l.tier), entry: l.entry })
                .collect();
            self.unpin(&beyond);
        }
        self.counters.lookups.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        bump(&self.counters.hit_blocks, hit);
        bump(&self.counters.miss_blocks, keys.len() - hit);
        hit
    }

    /// Copies leased blocks `0..dst.len()` into `dst` (each exactly `block_bytes`), verifying
    /// every checksum. If block `i` fails (here, or in an earlier load of the same stored copy),
    /// it is dropped from its tier and counted once, and `loaded_blocks = i`: the loaded prefix
    /// is consecutive and correct.
    pub fn load(&self, lease_id: u64, dst: &mut [&mut [u8]]) -> Result<LoadReport, StoreError> {
        self.load_range(lease_id, 0, dst)
    }

    /// Like [`load`](Self::load), for leased blocks `first..first + dst.len()` (a chunk of a
    /// lease, as the transfer engine's read stage takes them): `loaded_blocks` counts from
    /// `first`. A range past the lease's blocks is [`StoreError::LoadTooMany`]. A lease granted
    /// before a [`clear`](Self::clear) loads nothing after it (its blocks count as
    /// `load_missing`), and a clear waits for a load in flight.
    pub fn load_range(
        &self,
        lease_id: u64,
        first: usize,
        dst: &mut [&mut [u8]],
    ) -> Result<LoadReport, StoreError> {
        let _reading = self.enter();
        let (blocks, _in_flight) = self.begin_load(lease_id, first, dst)?;
        let outcomes = match blocks {
            Some(blocks) => self.read_promoting(&blocks, dst),
            None => vec![ReadOutcome::Missing; dst.len()],
        };
        self.hierarchy.hooks.at(HookPoint::LoadRead);
        let loaded_blocks = outcomes.iter().take_while(|&&o| o == ReadOutcome::Loaded).count();
        let checksum_failures = self.count_load(&outcomes, loaded_blocks);
        Ok(LoadReport { loaded_blocks, checksum_failures })
    }

    /// Reads `blocks` into `dst` and promotes the loaded prefix (the blocks before the first
    /// one not [`Loaded`](ReadOutcome::Loaded)) from tiers promoting on hit into DRAM; returns
    /// every block's outcome. A load with such blocks reads in chunks of halving size (half of
    /// what is left, down to [`PROMOTE_CHUNK_MIN_BYTES`]), promoting the prefix read so far on
    /// a second thread while the next chunk is read: a cold load's copies into DRAM hide behind
    /// its reads, and only the last, smallest chunk's are left after them. The same blocks are
    /// read, verified and promoted as in one batch.
    fn read_promoting(&self, blocks: &[LeasedBlock], dst: &mut [&mut [u8]]) -> Vec<ReadOutcome> {
        let min_chunk = (PROMOTE_CHUNK_MIN_BYTES / self.block_bytes.max(1)).max(1);
        let promotes = blocks.iter().any(|b| self.hierarchy.promotes_from(self.levels[b.tier].tier().kind()));
        if !promotes || blocks.len() <= 2 * min_chunk {
            let outcomes = self.read(blocks, dst, None);
            let loaded = outcomes.iter().take_while(|&&o| o == ReadOutcome::Loaded).count();
            let _ = self.promote(&blocks[..loaded], &dst[..loaded]);
            return outcomes;
        }
        let mut outcomes = Vec::with_capacity(blocks.len());
        let (mut loaded, mut promoted, mut start) = (0, 0, 0);
        while start < blocks.len() {
            let left = blocks.len() - start;
            let end = start + if left <= 2 * min_chunk { left } else { left / 2 };
            let (done, rest) = dst.split_at_mut(start);
            let (ready, ready_dst) = (&blocks[promoted..loaded], &done[promoted..loaded]);
            let read = std::thread::scope(|s| {
                if !ready.is_empty() {
                    s.spawn(|| self.promote(ready, ready_dst));
                }
                self.read(&blocks[start..end], &mut rest[..end - start], None)
            });
            promoted = loaded;
            outcomes.extend(read);
            if loaded == start {
                loaded += outcomes[start..].iter().take_while(|&&o| o == ReadOutcome::Loaded).count();
            }
            start = end;
        }
        let _ = self.promote(&blocks[promoted..loaded], &dst[promoted..loaded]);
        outcomes
    }

    /// Marks leased blocks `first..first + dst.len()` as being loaded (released when the guard
    /// drops) and checks the destinations' sizes: the start both load paths share. `None`: a
    /// clear dropped the lease's blocks (the load misses).
    fn begin_load(
        &self,
        lease_id: u64,
        first: usize,
        dst: &[&mut [u8]],
    ) -> Result<(Option<Vec<LeasedBlock>>, LoadGuard<'_>), StoreError> {
        let (blocks, guard) = self.begin_use(lease_id, first, dst.len())?;
        self.check_sizes(dst.iter().map(|d| d.len()))?;
        Ok((blocks, guard))
    }

    /// Leased blocks `first..first + count` of `lease_id`, marked in use as a load is (the lease
    /// is not reclaimed until the guard drops); `None` if a clear dropped them. The caller holds
    /// the gate ([`enter`](Self::enter)) for as long as the guard lives.
    fn begin_use(
        &self,
        lease_id: u64,
        first: usize,
        count: usize,
    ) -> Result<(Option<Vec<LeasedBlock>>, LoadGuard<'_>), StoreError> {
        let blocks = {
            let mut table = self.leases.lock();
            self.reclaim_expired(&mut table);
            table.begin_load_at(lease_id, first, count, Instant::now())?
        };
        Ok((blocks, LoadGuard { store: self, lease_id }))
    }

    /// Counts a load's outcomes (`loaded` blocks served); returns its checksum failures.
    fn count_load(&self, outcomes: &[ReadOutcome], loaded: usize) -> usize {
        let found_corrupt = outcomes.iter().filter(|&&o| o == ReadOutcome::Corrupt).count();
        let known_corrupt = outcomes.iter().filter(|&&o| o == ReadOutcome::CorruptKnown).count();
        bump(&self.counters.load_missing, outcomes.iter().filter(|&&o| o == ReadOutcome::Missing).count());
        assert!(!outcomes.contains(&ReadOutcome::NotPinned), "a leased block was not pinned");
        bump(&self.counters.loaded_blocks, loaded);
        bump(&self.counters.loaded_bytes, loaded * self.block_bytes);
        // Each corrupt stored copy is counted once, by the load that found it.
        bump(&self.counters.checksum_failures, found_corrupt);
        found_corrupt + known_corrupt
    }

    /// Reads `blocks` into `dst`, one batch per tier; with `forms`, lower-tier codec objects
    /// are verified and left encoded, `forms[i]` saying where block `i`'s payload is.
    fn read(
        &self,
        blocks: &[LeasedBlock],
        dst: &mut [&mut [u8]],
        mut forms: Option<&mut [StoredBlock]>,
    ) -> Vec<ReadOutcome> {
        let mut outcomes = vec![ReadOutcome::NotPinned; blocks.len()];
        for (t, level) in self.levels.iter().enumerate() {
            let mine: Vec<usize> = (0..blocks.len()).filter(|&i| blocks[i].tier == t).collect();
            if mine.is_empty() {
                continue;
            }
            let entries: Vec<EntryRef> = mine.iter().map(|&i| blocks[i].entry).collect();
            let mut tier_dst: Vec<&mut [u8]> =
                dst.iter_mut().zip(blocks).filter(|(_, b)| b.tier == t).map(|(d, _)| &mut **d).collect();
            let mut tier_outcomes = vec![ReadOutcome::NotPinned; mine.len()];
            let mut tier_forms = vec![StoredBlock::raw(self.block_bytes); mine.len()];
            let f = forms.is_some().then_some(&mut tier_forms[..]);
            let read = level.read(self.namespace_hash, &entries, &mut tier_dst, &mut tier_outcomes, f);
            bump(&self.counters.decode_failures, read.decode_failures);
            for ((&i, outcome), form) in mine.iter().zip(tier_outcomes).zip(tier_forms) {
                outcomes[i] = outcome;
                if let Some(forms) = forms.as_deref_mut() {
                    forms[i] = form;
                }
            }
        }
        outcomes
    }

    /// Puts the blocks of a load that came from a tier promoting on hit into DRAM (`dst[i]` is
    /// `blocks[i]` decoded); returns how many.
    pub(crate) fn promote<D: AsRef<[u8]>>(&self, blocks: &[LeasedBlock], dst: &[D]) -> usize {
        let (keys, objects): (Vec<BlockKey>, Vec<&[u8]>) = blocks
            .iter()
            .zip(dst)
            .filter(|(b, _)| self.hierarchy.promotes_from(self.levels[b.tier].tier().kind()))
            .map(|(b, d)| (b.entry.key, d.as_ref()))
            .unzip();
        self.hierarchy.promote(&self.counters, &keys, &objects)
    }

    /// Ends a lease, unpinning its blocks (after any load in flight on it finishes).
    /// Idempotent: releasing a lease that already ended (released, or expired however long
    /// ago) is `Ok`; only an id this store never granted is [`StoreError::LeaseUnknown`].
    pub fn release(&self, lease_id: u64) -> Result<(), StoreError> {
        let mut table = self.leases.lock();
        if let Some(blocks) = table.release(lease_id)? {
            self.unpin(&blocks);
        }
        self.reclaim_expired(&mut table);
        Ok(())
    }

    fn unpin(&self, blocks: &[LeasedBlock]) {
        for (t, tier) in self.tiers().enumerate() {
            let entries: Vec<EntryRef> = blocks.iter().filter(|b| b.tier == t).map(|b| b.entry).collect();
            if !entries.is_empty() {
                tier.unpin(&entries);
            }
        }
    }

    /// Reclaims expired leases; the caller holds the lease table's lock.
    fn reclaim_expired(&self, table: &mut LeaseTable) {
        let blocks = table.reclaim_expired(Instant::now());
        if !blocks.is_empty() {
            self.unpin(&blocks);
        }
    }
}

/// Ends a load on drop, so a panicking copy cannot leave its lease unreclaimable.
struct LoadGuard<'a> {
    store: &'a Store,
    lease_id: u64,
}

impl Drop for LoadGuard<'_> {
    fn drop(&mut self) {
        let mut table = self.store.leases.lock();
        if let Some(blocks) = table.end_load(self.lease_id) {
            self.store.unpin(&blocks);
        }
    }
}
