//! [`Store`]: the tier hierarchy behind one namespace, with leases.

use std::sync::Arc;
use std::time::Instant;

use kvtier_core::parallel::WorkerPool;
use kvtier_core::{BlockKey, Namespace};
use kvtier_pool::ssd::SsdMetrics;
use kvtier_pool::{
    eviction_by_name, object_extent_bytes, DramTier, EntryRef, Located, PoolError, ReadOutcome, SsdTier,
    Tier, TierKind, TierStats, PAGE_BYTES,
};
use kvtier_remote::{RemoteMetrics, RemoteTier};
use parking_lot::Mutex;

use crate::codec_stage::TierEncoder;
use crate::config::{StoreConfig, TierCodec};
use crate::error::StoreError;
use crate::hierarchy::{HierarchyPut, TierWrites};
use crate::lease::{LeaseTable, LeasedBlock};
use crate::stats::{bump, read, Counters, StoreStats};

mod pool;
mod staging;
pub use pool::PoolLoadReport;

/// Result of [`Store::lookup`]: the longest consecutive prefix of present blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lookup {
    pub hit_blocks: usize,
    /// Where each hit block lives; `tiers.len() == hit_blocks`.
    pub tiers: Vec<TierKind>,
}

/// Result of [`Store::lease`]: like [`Lookup`], and the hit blocks are pinned until
/// [`Store::release`] or TTL expiry. Every lease (even one with 0 hits) must be released.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub id: u64,
    pub hit_blocks: usize,
    pub tiers: Vec<TierKind>,
}

/// Result of [`Store::put`]. `stored + already_present + rejected` equals the keys given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PutReport {
    /// Blocks this put wrote: into DRAM, or, where DRAM had no room, through (or by demotion)
    /// to SSD or the remote tier.
    pub stored: usize,
    /// Blocks DRAM held (or a lower tier, for those DRAM had no room for).
    pub already_present: usize,
    /// Blocks no tier holds after the put: DRAM had no room (every block that could make room
    /// is leased, or the put is larger than DRAM) and no lower tier took them.
    pub rejected: usize,
    /// Blocks evicted from DRAM to make room for this put.
    pub evicted: usize,
    /// New copies written to each tier by this put.
    pub written: TierWrites,
}

/// Result of [`Store::load`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Destinations `0..loaded_blocks` hold verified bytes; later ones must not be used.
    pub loaded_blocks: usize,
    /// Blocks of this load that failed verification (each dropped from its tier). A stored copy
    /// found corrupt by an earlier load is reported again here, but counted only once in
    /// [`StoreStats::checksum_failures`](crate::StoreStats).
    pub checksum_failures: usize,
}

/// Where one block read undecoded by [`Store::load_range_stored`] sits in its destination:
/// `dst[offset..offset + len]` is the verified payload of codec `codec_id` (0: raw, the block
/// itself, `offset` 0 and `len` = `block_bytes`; 1 `lossless`, 2 `quant`: a `KVCP` payload
/// whose header declares `block_bytes` decoded bytes). Bytes of `dst` outside it are unspecified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoredBlock {
    pub codec_id: u16,
    pub offset: usize,
    pub len: usize,
}

impl StoredBlock {
    /// A raw block of `block_bytes`.
    pub fn raw(block_bytes: usize) -> Self {
        StoredBlock { codec_id: 0, offset: 0, len: block_bytes }
    }
}

/// Result of [`Store::load_range_stored`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredLoadReport {
    /// Per block of the range: where its verified stored bytes are, or `None` if it failed
    /// verification or its read failed (dropped from its tier and counted, as in
    /// [`Store::load`]); its destination bytes must not be used then.
    pub blocks: Vec<Option<StoredBlock>>,
    /// Blocks of this load that failed verification (as [`LoadReport::checksum_failures`]).
    pub checksum_failures: usize,
}

/// A hierarchical KV-cache store for one [`Namespace`]. `Send + Sync`; share it by reference
/// or `Arc` between threads.
pub struct Store {
    namespace: Namespace,
    namespace_hash: u128,
    block_bytes: usize,
    config: StoreConfig,
    /// The hierarchy, fastest first; at most one tier of each kind.
    tiers: Vec<Arc<dyn Tier>>,
    /// The same tiers, typed, for moving blocks between them.
    pub(crate) dram: Arc<DramTier>,
    pub(crate) ssd: Option<Arc<SsdTier>>,
    pub(crate) remote: Option<Arc<RemoteTier>>,
    /// Encoders for blocks written to SSD and remote (raw without a codec configured).
    pub(crate) ssd_encoder: TierEncoder,
    pub(crate) remote_encoder: TierEncoder,
    /// Lock order: `leases`, then a tier's lock. Pins change only under `leases`.
    leases: Mutex<LeaseTable>,
    pub(crate) counters: Counters,
    /// Reused buffers for whole objects between an engine pool and the lower tiers.
    staging: staging::Staging,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tiers: Vec<&str> = self.tiers.iter().map(|t| t.kind().name()).collect();
        f.debug_struct("Store")
            .field("namespace", &self.namespace)
            .field("block_bytes", &self.block_bytes)
            .field("config", &self.config)
            .field("tiers", &tiers)
            .finish()
    }
}

impl Store {
    /// A store with a DRAM tier of `config.dram_capacity_bytes` and, with `config.ssd`, an SSD
    /// pool below it (opened, and recovered from its index log, here).
    pub fn new(namespace: Namespace, config: StoreConfig) -> Result<Store, StoreError> {
        config.validate()?;
        let namespace_hash = namespace.hash().map_err(|e| StoreError::Config(format!("namespace: {e}")))?;
        let block_bytes = usize::try_from(namespace.geometry.block_bytes())
            .map_err(|_| StoreError::Config("block_bytes does not fit this machine's usize".into()))?;
        let object_bytes = object_extent_bytes(block_bytes as u64);
        let usable = config.dram_capacity_bytes / PAGE_BYTES * PAGE_BYTES;
        if usable < object_bytes {
            return Err(StoreError::Config(format!(
                "dram_capacity_bytes is {} and holds no block; expected at least {object_bytes} \
                 (64-byte header + {block_bytes}-byte block, rounded up to {PAGE_BYTES}-byte pages)",
                config.dram_capacity_bytes
            )));
        }
        let geometry = &namespace.geometry;
        let ssd_codec = config.ssd.as_ref().map_or(TierCodec::Raw, |s| s.codec.clone());
        let remote_codec = config.remote.as_ref().map_or(TierCodec::Raw, |r| r.codec.clone());
        let ssd_encoder = TierEncoder::new(&ssd_codec, "ssd", geometry)?;
        let remote_encoder = TierEncoder::new(&remote_codec, "remote", geometry)?;
        let policy = eviction_by_name(&config.eviction).map_err(|e| StoreError::Config(e.to_string()))?;
        let workers = Arc::new(WorkerPool::new(config.copy_threads));
        let dram = DramTier::new(config.dram_capacity_bytes, policy, workers)?;
        if config.dram_prefault {
            // A failed prefault only means pages fault in on first use, as without it.
            let _ = dram.prefault();
        }
        let dram = Arc::new(dram);
        let mut tiers: Vec<Arc<dyn Tier>> = vec![dram.clone()];
        let ssd = match &config.ssd {
            None => None,
            Some(ssd_config) => {
                let mut pool = ssd_config.pool.clone();
                pool.min_object_bytes = (block_bytes as u64).div_ceil(PAGE_BYTES).max(1) * PAGE_BYTES;
                pool.eviction = config.eviction.clone();
                let ssd = Arc::new(SsdTier::open(pool).map_err(|e| match e {
                    PoolError::SsdConfig(message) => StoreError::Config(format!("ssd: {message}")),
                    other => StoreError::Tier(other),
                })?);
                tiers.push(ssd.clone());
                Some(ssd)
            }
        };
        let remote = crate::hierarchy::open_remote(&config, namespace_hash)?;
        if let Some(remote) = &remote {
            tiers.push(remote.clone());
        }
        let leases = Mutex::new(LeaseTable::new(config.lease_ttl, config.leases_max));
        Ok(Store {
            namespace,
            namespace_hash,
            block_bytes,
            config,
            tiers,
            dram,
            ssd,
            remote,
            ssd_encoder,
            remote_encoder,
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
        self.tiers.iter().map(|t| t.kind()).collect()
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
        self.tiers.iter().position(|t| t.kind() == kind).expect("located in a tier of this store")
    }

    /// Stores `objects[i]` (the BlockFirst payload of `keys[i]`, exactly `block_bytes`) in the
    /// fastest tier. Keys already present are skipped; when every block that could make room
    /// is leased, the rest are rejected (capacity is never exceeded). With an SSD tier, blocks
    /// DRAM gives up for room are first written to SSD (write-back, after the admission filter).
    pub fn put(
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
        let put = self.put_hierarchy(keys, objects);
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
        let last = self.tiers.len() - 1;
        for (i, tier) in self.tiers.iter().enumerate() {
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

    /// The longest consecutive prefix of `keys` present in any tier, and where each block is.
    /// Nothing is pinned: use [`lease`](Self::lease) before loading.
    pub fn lookup(&self, namespace_hash: u128, keys: &[BlockKey]) -> Result<Lookup, StoreError> {
        self.check_namespace(namespace_hash)?;
        let mut located = vec![None; keys.len()];
        let hit_blocks = self.locate(keys, &mut located, false);
        let tiers = located[..hit_blocks].iter().map(|l| l.expect("prefix is located").tier).collect();
        Ok(Lookup { hit_blocks, tiers })
    }

    /// Like [`lookup`](Self::lookup), and pins the hit prefix so eviction cannot remove it
    /// until [`release`](Self::release) or `lease_ttl` passes.
    pub fn lease(&self, namespace_hash: u128, keys: &[BlockKey]) -> Result<Lease, StoreError> {
        self.check_namespace(namespace_hash)?;
        let mut table = self.leases.lock();
        self.reclaim_expired(&mut table);
        table.has_room()?;
        let mut located = vec![None; keys.len()];
        let hit_blocks = self.locate(keys, &mut located, true);
        let mut tiers = Vec::with_capacity(hit_blocks);
        let mut blocks = Vec::with_capacity(hit_blocks);
        for l in located[..hit_blocks].iter().map(|l| l.expect("prefix is located")) {
            tiers.push(l.tier);
            blocks.push(LeasedBlock { tier: self.tier_index(l.tier), entry: l.entry });
        }
        let id = table.grant(blocks, Instant::now());
        Ok(Lease { id, hit_blocks, tiers })
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
    /// `first`. A range past the lease's blocks is [`StoreError::LoadTooMany`].
    pub fn load_range(
        &self,
        lease_id: u64,
        first: usize,
        dst: &mut [&mut [u8]],
    ) -> Result<LoadReport, StoreError> {
        let (blocks, _in_flight) = self.begin_load(lease_id, first, dst)?;
        let outcomes = self.read(&blocks, dst, None);
        let loaded_blocks = outcomes.iter().take_while(|&&o| o == ReadOutcome::Loaded).count();
        let checksum_failures = self.count_load(&outcomes, loaded_blocks);
        let _ = self.promote(&blocks[..loaded_blocks], dst);
        Ok(LoadReport { loaded_blocks, checksum_failures })
    }

    /// Marks leased blocks `first..first + dst.len()` as being loaded (released when the guard
    /// drops) and checks the destinations' sizes: the start both load paths share.
    fn begin_load(
        &self,
        lease_id: u64,
        first: usize,
        dst: &[&mut [u8]],
    ) -> Result<(Vec<LeasedBlock>, LoadGuard<'_>), StoreError> {
        let (blocks, guard) = self.begin_use(lease_id, first, dst.len())?;
        self.check_sizes(dst.iter().map(|d| d.len()))?;
        Ok((blocks, guard))
    }

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
        let (blocks, _in_flight) = self.begin_load(lease_id, first, dst)?;
        let mut forms = vec![StoredBlock::raw(self.block_bytes); dst.len()];
        let outcomes = self.read(&blocks, dst, Some(&mut forms));
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
        let (blocks, _in_flight) = self.begin_use(lease_id, first, last + 1 - first)?;
        bump(&self.counters.decode_failures, leased.len());
        let mut dropped = 0;
        for (t, tier) in self.tiers.iter().enumerate() {
            let keys: Vec<BlockKey> = leased
                .iter()
                .map(|&i| blocks[i - first])
                .filter(|b| b.tier == t)
                .map(|b| b.entry.key)
                .collect();
            if !keys.is_empty() {
                dropped += tier.remove(self.namespace_hash, &keys);
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
        let (blocks, _in_flight) = self.begin_use(lease_id, first, decoded.len())?;
        if !self.promotes_on_hit() {
            return Ok(0);
        }
        let (chosen, data): (Vec<LeasedBlock>, Vec<&[u8]>) =
            blocks.iter().zip(decoded).filter_map(|(b, d)| d.map(|d| (*b, d))).unzip();
        Ok(self.promote(&chosen, &data))
    }

    /// Leased blocks `first..first + count` of `lease_id`, marked in use as a load is (the lease
    /// is not reclaimed until the guard drops).
    fn begin_use(
        &self,
        lease_id: u64,
        first: usize,
        count: usize,
    ) -> Result<(Vec<LeasedBlock>, LoadGuard<'_>), StoreError> {
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
        for (t, tier) in self.tiers.iter().enumerate() {
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
            // Lower tiers may hold codec objects: decoded by their headers (`hierarchy.rs`).
            match tier.kind() {
                TierKind::Ssd => self.read_ssd(&entries, &mut tier_dst, &mut tier_outcomes, f),
                TierKind::Remote => self.read_remote(&entries, &mut tier_dst, &mut tier_outcomes, f),
                _ => tier.read_pinned(self.namespace_hash, &entries, &mut tier_dst, &mut tier_outcomes),
            }
            for ((&i, outcome), form) in mine.iter().zip(tier_outcomes).zip(tier_forms) {
                outcomes[i] = outcome;
                if let Some(forms) = forms.as_deref_mut() {
                    forms[i] = form;
                }
            }
        }
        outcomes
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
        for (t, tier) in self.tiers.iter().enumerate() {
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

    pub fn stats(&self) -> StoreStats {
        let (leases_active, leases_expired) = {
            let mut table = self.leases.lock();
            self.reclaim_expired(&mut table);
            (table.active() as u64, table.expired_total)
        };
        let c = &self.counters;
        let mut stats = StoreStats {
            lookups: read(&c.lookups),
            hit_blocks: read(&c.hit_blocks),
            miss_blocks: read(&c.miss_blocks),
            put_blocks: read(&c.put_blocks),
            put_bytes: read(&c.put_bytes),
            loaded_blocks: read(&c.loaded_blocks),
            loaded_bytes: read(&c.loaded_bytes),
            evictions: read(&c.evictions),
            rejected_puts: read(&c.rejected_puts),
            checksum_failures: read(&c.checksum_failures),
            leases_active,
            leases_expired,
            demoted_blocks: read(&c.demoted_blocks),
            admission_skipped: read(&c.admission_skipped),
            demotion_failed: read(&c.demotion_failed),
            promoted_blocks: read(&c.promoted_blocks),
            written_through: read(&c.written_through),
            dropped_evictions: read(&c.dropped_evictions),
            remote_written: read(&c.remote_written),
            remote_write_failed: read(&c.remote_write_failed),
            load_missing: read(&c.load_missing),
            ssd_encoded_blocks: read(&c.ssd_encoded_blocks),
            ssd_encoded_bytes_before: read(&c.ssd_encoded_bytes_before),
            ssd_encoded_bytes_after: read(&c.ssd_encoded_bytes_after),
            ssd_encode_fallbacks: read(&c.ssd_encode_fallbacks),
            remote_encoded_blocks: read(&c.remote_encoded_blocks),
            remote_encoded_bytes_before: read(&c.remote_encoded_bytes_before),
            remote_encoded_bytes_after: read(&c.remote_encoded_bytes_after),
            remote_encode_fallbacks: read(&c.remote_encode_fallbacks),
            decode_failures: read(&c.decode_failures),
            ..StoreStats::default()
        };
        for tier in &self.tiers {
            let t = tier.stats();
            stats.objects += t.objects;
            stats.used_bytes += t.used_bytes;
            stats.capacity_bytes += t.capacity_bytes;
        }
        stats
    }

    /// Each tier's own counters and gauges, fastest tier first.
    pub fn tier_stats(&self) -> Vec<(TierKind, TierStats)> {
        self.tiers.iter().map(|t| (t.kind(), t.stats())).collect()
    }

    /// The SSD pool's metrics (per device bytes, queue depth, latency percentiles; recovery),
    /// or `None` without an SSD tier.
    pub fn ssd_metrics(&self) -> Option<SsdMetrics> {
        self.ssd.as_ref().map(|s| s.metrics())
    }

    /// The remote tier's metrics (per-operation latency, bytes, errors; reconnects; misses while
    /// down; bad values), or `None` without a remote tier.
    pub fn remote_metrics(&self) -> Option<RemoteMetrics> {
        self.remote.as_ref().map(|r| r.metrics())
    }

    /// Makes every block the SSD tier holds durable now (no-op without one).
    pub fn flush(&self) -> Result<(), StoreError> {
        match &self.ssd {
            Some(ssd) => ssd.flush().map_err(|e| {
                StoreError::Tier(PoolError::SsdIo {
                    what: "flushing",
                    path: ssd.config().directory.display().to_string(),
                    reason: e.to_string(),
                })
            }),
            None => Ok(()),
        }
    }

    /// Verifies every tier (allocator accounting, index/extents, object headers, policy) and
    /// that each tier's pin counts equal what active leases hold.
    pub fn check_integrity(&self) -> Result<(), StoreError> {
        let table = self.leases.lock();
        table.check_integrity().map_err(StoreError::Integrity)?;
        let mut expected = table.expected_pins();
        for (t, tier) in self.tiers.iter().enumerate() {
            tier.check_integrity()?;
            if tier.used_bytes() > tier.capacity_bytes() {
                return Err(StoreError::Integrity(format!(
                    "{} tier uses {} bytes of {}",
                    tier.kind(),
                    tier.used_bytes(),
                    tier.capacity_bytes()
                )));
            }
            for (entry, pins) in tier.pins() {
                let leased = expected.remove(&(t, entry)).unwrap_or(0);
                if leased != pins {
                    return Err(StoreError::Integrity(format!(
                        "{} tier: {entry:?} has {pins} pins; leases hold {leased}",
                        tier.kind()
                    )));
                }
            }
        }
        if let Some(((t, entry), n)) = expected.into_iter().next() {
            return Err(StoreError::Integrity(format!(
                "leases hold {n} pins on {entry:?} in the {} tier, which has none",
                self.tiers[t].kind()
            )));
        }
        Ok(())
    }

    /// Flips one bit of a stored payload (fault injection). False, changing nothing, if no tier
    /// holds `key` unleased (a leased block may be being loaded: flipping then would race with
    /// the load) or the offset is past the payload.
    #[cfg(feature = "test-hooks")]
    pub fn corrupt_for_test(&self, key: BlockKey, payload_byte_offset: usize) -> bool {
        self.tiers.iter().any(|t| t.corrupt_for_test(key, payload_byte_offset))
    }

    /// Fault injection (tests): fail every read (or, with `write`, write) of SSD device `device`
    /// with `errno` (0 clears). False, changing nothing, without an SSD tier or such a device.
    #[cfg(feature = "test-hooks")]
    pub fn inject_ssd_error_for_test(&self, device: usize, write: bool, errno: i32) -> bool {
        match &self.ssd {
            Some(ssd) if device < ssd.device_count() => {
                ssd.inject_device_error_for_test(device, write, errno);
                true
            }
            _ => false,
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
