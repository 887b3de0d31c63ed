//! The DRAM tier: a bounded host [`Arena`], an [`ExtentAllocator`] over it, an
//! [`EvictionPolicy`] and an index `key → entry`.
//!
//! Each object is stored whole in one extent: the payload first (so it starts on a 4 KiB page,
//! and a lower tier can write it with O_DIRECT straight from the arena, without a copy), then
//! the 64-byte [`ObjectHeader`], then zero padding to the end of the extent (payload + header
//! rounded up to 4 KiB pages; `docs/formats.md` §2).
//!
//! Concurrency: one mutex guards the allocator, policy and index; it is taken a bounded number
//! of times per *batch* (put: reserve, publish; read: find, settle failures). Payload copies run
//! outside it, spread over the [`WorkerPool`]. That is sound because:
//! - a *writing* extent is reachable only from the batch that reserved it (invisible to lookups,
//!   never a victim), so its writer has it to itself;
//! - a *pinned* extent is never freed or reused, so readers of a pinned entry see bytes no one
//!   writes. ([`Tier::corrupt_for_test`] writes only an *unpinned* ready entry, under the lock:
//!   reads need a pin, taken under that lock, so none can be in flight on it.)
//!
//! Invariants (asserted on the way, verified by [`Tier::check_integrity`]): used ≤ capacity;
//! allocator extents = index extents + doomed extents, without overlap; the policy tracks
//! exactly the ready entries; writing entries hold no pins; doomed entries hold at least one;
//! every ready entry's header decodes and names its key and length.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvtier_core::checksum::copy_with_checksum;
use kvtier_core::object::CODEC_RAW;
use kvtier_core::paged::PagedPool;
use kvtier_core::parallel::WorkerPool;
use kvtier_core::{BlockKey, ObjectHeader};
use parking_lot::Mutex;

pub mod demote;
mod into_pool;
mod payloads;
pub mod pinned;
mod state;

use payloads::{Payloads, WriteJob};
pub use state::object_extent_bytes;
use state::{DramState, Entry, EntryState, PinnedAt, HEADER};

use crate::arena::Arena;
use crate::error::{integrity, IntegrityError, PoolError};
use crate::eviction::EvictionPolicy;
use crate::extent::{ExtentAllocator, PAGE_BYTES};
use crate::tier::{
    locate_each, ClearError, EntryRef, Located, ReadOutcome, Tier, TierKind, TierPutReport, TierStats,
};

/// Unit of parallel prefaulting, in bytes.
const PREFAULT_CHUNK_BYTES: usize = 64 << 20;

/// The host-memory tier.
pub struct DramTier {
    arena: Arena,
    workers: Arc<WorkerPool>,
    state: Mutex<DramState>,
}

struct ReadJob<'a> {
    item: usize,
    key: BlockKey,
    offset: usize,
    dst: Mutex<&'a mut [u8]>,
    corrupt: AtomicBool,
}

impl DramTier {
    /// A DRAM tier holding at most `capacity_bytes` (rounded down to whole pages).
    pub fn new(
        capacity_bytes: u64,
        policy: Box<dyn EvictionPolicy>,
        workers: Arc<WorkerPool>,
    ) -> Result<Self, PoolError> {
        if capacity_bytes < PAGE_BYTES {
            return Err(PoolError::CapacityTooSmall { bytes: capacity_bytes, page: PAGE_BYTES });
        }
        let allocator = ExtentAllocator::new(capacity_bytes);
        let arena = Arena::new(allocator.capacity_bytes())?;
        let state = DramState::new(allocator, policy);
        Ok(DramTier { arena, workers, state: Mutex::new(state) })
    }

    /// Faults in the whole arena now, spread over the worker pool, so the first fill of the
    /// tier runs at memory speed instead of page-fault speed. This commits `capacity_bytes` of
    /// host memory at once. Returns false if the kernel cannot populate (pages then fault in
    /// on first use).
    pub fn prefault(&self) -> bool {
        let len = self.arena.len_bytes();
        let chunks: Vec<usize> = (0..len).step_by(PREFAULT_CHUNK_BYTES).collect();
        let failed = AtomicBool::new(false);
        self.workers.for_each(&chunks, len, |&offset| {
            if !self.arena.prefault(offset, PREFAULT_CHUNK_BYTES.min(len - offset)) {
                failed.store(true, Ordering::Relaxed);
            }
        });
        !failed.load(Ordering::Relaxed)
    }

    /// Name of the eviction policy in use.
    pub fn eviction_name(&self) -> &'static str {
        self.state.lock().policy.name()
    }

    /// Reserves space for every new key of the batch (evicting only with `evict`); returns the
    /// copy jobs. Items refused for lack of space go to `refused`.
    fn reserve(
        &self,
        namespace: u128,
        keys: &[BlockKey],
        payloads: &Payloads<'_>,
        evict: bool,
        report: &mut TierPutReport,
        refused: &mut Vec<usize>,
    ) -> Vec<WriteJob> {
        let mut jobs = Vec::with_capacity(keys.len());
        let mut st = self.state.lock();
        let mut victims_left = evict;
        for (item, &key) in keys.iter().enumerate() {
            if let Some(entry) = st.index.get_mut(&key) {
                if entry.namespace != namespace {
                    // Another namespace's copy: never overwritten, and not this namespace's hit.
                    report.rejected += 1;
                    continue;
                }
                entry.accesses = entry.accesses.saturating_add(1); // produced again: a use
                report.already_present += 1;
                continue;
            }
            let payload_len = payloads.payload_len(item) as u64;
            let need = object_extent_bytes(payload_len);
            let Some(extent) = st.allocate_evicting(need, &mut victims_left, &mut report.evicted) else {
                report.rejected += 1;
                refused.push(item);
                continue;
            };
            let id = st.next_entry_id;
            st.next_entry_id += 1;
            let entry = Entry {
                id,
                extent,
                payload_len,
                namespace,
                pins: 0,
                state: EntryState::Writing,
                accesses: 1,
            };
            st.index.insert(key, entry);
            st.writing += 1;
            let offset = usize::try_from(extent.offset).expect("arena offsets fit usize");
            let extent_len = usize::try_from(extent.len).expect("extent lengths fit usize");
            jobs.push(WriteJob { item, offset, extent_len });
        }
        if evict {
            // Without eviction, refusals are the caller's to retry (after demoting), not rejections.
            st.counters.rejected += report.rejected as u64;
        }
        assert!(st.allocator.used_bytes() <= st.allocator.capacity_bytes());
        jobs
    }

    /// Writes the objects of `run` (a task of [`Payloads::copy_runs`]): payloads, then headers.
    fn write_run(&self, namespace: u128, keys: &[BlockKey], payloads: &Payloads<'_>, run: &[&WriteJob]) {
        // SAFETY: each extent belongs to a writing entry reserved by this batch (distinct
        // extents); nothing else reads or writes it until the entry is published under the lock.
        let mut extents: Vec<&mut [u8]> =
            run.iter().map(|job| unsafe { self.arena.bytes_mut(job.offset, job.extent_len) }).collect();
        let items: Vec<usize> = run.iter().map(|job| job.item).collect();
        let (mut dsts, mut rests): (Vec<&mut [u8]>, Vec<&mut [u8]>) = extents
            .iter_mut()
            .zip(&items)
            .map(|(extent, &item)| extent.split_at_mut(payloads.payload_len(item)))
            .unzip();
        let sums = payloads.copy_run(&items, &mut dsts);
        for ((rest, &item), sum) in rests.iter_mut().zip(&items).zip(sums) {
            let len = payloads.payload_len(item) as u64;
            let (head, padding) = rest.split_at_mut(HEADER);
            head.copy_from_slice(
                &ObjectHeader::with_checksum(namespace, keys[item], CODEC_RAW, len, sum).encode(),
            );
            padding.fill(0);
        }
    }

    /// Stores a batch like [`Tier::put`], evicting only with `evict`; without it, items that do
    /// not fit in free space are refused and their indexes pushed to `refused` (so the caller
    /// can demote victims to a lower tier first and retry).
    pub fn put_with(
        &self,
        namespace: u128,
        keys: &[BlockKey],
        payloads: &[&[u8]],
        evict: bool,
        refused: &mut Vec<usize>,
    ) -> TierPutReport {
        self.put_payloads(namespace, keys, &Payloads::Slices(payloads), evict, refused)
    }

    /// Stores pool block `blocks[i]` of `pool` under `keys[i]`, each gathered straight into its
    /// arena extent (one copy, checksummed on the way), evicting as [`Tier::put`] does.
    ///
    /// Panics (a caller bug) if the lengths differ or a block id is out of range. The caller
    /// must not write the pool blocks being stored until the call returns.
    pub fn put_from_pool(
        &self,
        namespace: u128,
        keys: &[BlockKey],
        pool: &PagedPool,
        blocks: &[usize],
    ) -> TierPutReport {
        assert!(blocks.iter().all(|&b| b < pool.num_blocks()), "pool block ids in range");
        self.put_payloads(namespace, keys, &Payloads::Pool { pool, blocks }, true, &mut Vec::new())
    }

    fn put_payloads(
        &self,
        namespace: u128,
        keys: &[BlockKey],
        payloads: &Payloads<'_>,
        evict: bool,
        refused: &mut Vec<usize>,
    ) -> TierPutReport {
        assert_eq!(keys.len(), payloads.len(), "one payload per key");
        let mut report = TierPutReport::default();
        let jobs = self.reserve(namespace, keys, payloads, evict, &mut report, refused);
        let mut abandon = AbandonOnPanic { tier: self, keys, jobs: &jobs, armed: true };
        let total_bytes = jobs.iter().map(|j| payloads.payload_len(j.item)).sum();
        self.workers.for_each(&payloads.copy_runs(&jobs), total_bytes, |run| {
            self.write_run(namespace, keys, payloads, run);
        });
        abandon.armed = false;
        drop(abandon);
        let mut st = self.state.lock();
        for job in &jobs {
            let key = keys[job.item];
            let entry = st.index.get_mut(&key).expect("writing entries stay indexed");
            assert_eq!(entry.state, EntryState::Writing, "a writing entry changed under its writer");
            entry.state = EntryState::Ready;
            st.policy.on_insert(key);
            st.writing -= 1;
        }
        st.counters.stored += jobs.len() as u64;
        report.stored = jobs.len();
        report
    }

    /// Verifies the stored header and copies the payload out; false if anything mismatches.
    fn read_object(&self, namespace: u128, job: &ReadJob<'_>) -> bool {
        let mut dst = job.dst.lock();
        // SAFETY: the entry is pinned, so its extent is neither freed nor rewritten meanwhile.
        let header_bytes = unsafe { self.arena.bytes(job.offset + dst.len(), HEADER) };
        let Ok(header) = ObjectHeader::decode(header_bytes) else { return false };
        if header.expect_identity(namespace, job.key).is_err() || header.payload_len != dst.len() as u64 {
            return false;
        }
        // SAFETY: as above.
        let src = unsafe { self.arena.bytes(job.offset, dst.len()) };
        copy_with_checksum(&mut dst, src) == header.payload_checksum
    }

    /// Settles the items of a read found corrupt (`outcomes[item]` is `Corrupt`): each stored
    /// copy is doomed and counted once, by the read that found it; a concurrent read that found
    /// the same copy corrupt reports it as already known.
    fn settle_corrupt(&self, entries: &[EntryRef], corrupt: &[usize], outcomes: &mut [ReadOutcome]) {
        if corrupt.is_empty() {
            return;
        }
        let mut st = self.state.lock();
        for &item in corrupt {
            let entry = entries[item];
            if st.index.get(&entry.key).is_some_and(|e| e.id == entry.entry_id) {
                st.retire(entry.key, true);
            } else if let Some(doomed) = st.doomed.get_mut(&entry.entry_id).filter(|d| d.key == entry.key) {
                if doomed.corrupt {
                    outcomes[item] = ReadOutcome::CorruptKnown;
                    continue;
                }
                doomed.corrupt = true;
            }
            st.counters.checksum_failures += 1;
        }
    }
}

impl Tier for DramTier {
    fn kind(&self) -> TierKind {
        TierKind::Dram
    }

    fn capacity_bytes(&self) -> u64 {
        self.state.lock().allocator.capacity_bytes()
    }

    fn used_bytes(&self) -> u64 {
        self.state.lock().allocator.used_bytes()
    }

    fn put(&self, namespace: u128, keys: &[BlockKey], payloads: &[&[u8]]) -> TierPutReport {
        self.put_with(namespace, keys, payloads, true, &mut Vec::new())
    }

    fn locate(
        &self,
        namespace: u128,
        keys: &[BlockKey],
        located: &mut [Option<Located>],
        pin: bool,
        stop_at_miss: bool,
    ) -> usize {
        let st = &mut *self.state.lock();
        locate_each(TierKind::Dram, keys, located, stop_at_miss, |_, key| {
            let entry = st.index.get_mut(key).filter(|e| e.visible() && e.namespace == namespace)?;
            if pin {
                if entry.pins == 0 {
                    st.pinned_ready += 1;
                }
                entry.pins = entry.pins.checked_add(1).expect("pin count overflow");
                entry.accesses = entry.accesses.saturating_add(1);
                if entry.state == EntryState::Ready {
                    st.policy.on_access(*key);
                }
            }
            Some(entry.id)
        })
    }

    fn read_pinned(
        &self,
        namespace: u128,
        entries: &[EntryRef],
        dst: &mut [&mut [u8]],
        outcomes: &mut [ReadOutcome],
    ) {
        assert!(entries.len() == dst.len() && dst.len() == outcomes.len(), "one destination per entry");
        let mut jobs = Vec::with_capacity(entries.len());
        {
            let st = self.state.lock();
            for (item, (entry, d)) in entries.iter().zip(dst.iter_mut()).enumerate() {
                let (extent, payload_len) = match st.find_pinned(entry) {
                    Some(PinnedAt::Ready(extent, len) | PinnedAt::Doomed(extent, len, false)) => {
                        (extent, len)
                    }
                    Some(PinnedAt::Doomed(_, _, true)) => {
                        // Found corrupt by an earlier read, and counted then: fails again, unread.
                        outcomes[item] = ReadOutcome::CorruptKnown;
                        continue;
                    }
                    None => {
                        outcomes[item] = ReadOutcome::NotPinned;
                        continue;
                    }
                };
                assert_eq!(d.len() as u64, payload_len, "destination {item} has the wrong length");
                let offset = usize::try_from(extent.offset).expect("arena offsets fit usize");
                let dst = Mutex::new(&mut **d);
                jobs.push(ReadJob { item, key: entry.key, offset, dst, corrupt: AtomicBool::new(false) });
            }
        }
        let total_bytes = jobs.iter().map(|j| j.dst.lock().len()).sum();
        self.workers.for_each(&jobs, total_bytes, |job| {
            if !self.read_object(namespace, job) {
                job.corrupt.store(true, Ordering::Relaxed);
            }
        });
        let mut corrupt = Vec::new();
        for job in &jobs {
            let bad = job.corrupt.load(Ordering::Relaxed);
            outcomes[job.item] = if bad { ReadOutcome::Corrupt } else { ReadOutcome::Loaded };
            if bad {
                corrupt.push(job.item);
            }
        }
        self.settle_corrupt(entries, &corrupt, outcomes);
    }

    fn unpin(&self, entries: &[EntryRef]) {
        let mut st = self.state.lock();
        for entry in entries {
            st.unpin(entry);
        }
    }

    fn contains(&self, namespace: u128, key: BlockKey) -> bool {
        self.state.lock().index.get(&key).is_some_and(|e| e.visible() && e.namespace == namespace)
    }

    fn remove(&self, namespace: u128, keys: &[BlockKey]) -> usize {
        self.state.lock().remove_where(namespace, keys.iter().map(|&key| (key, None)))
    }

    fn remove_entries(&self, namespace: u128, entries: &[EntryRef]) -> usize {
        self.state.lock().remove_where(namespace, entries.iter().map(|e| (e.key, Some(e.entry_id))))
    }

    fn clear(&self, namespace: u128) -> Result<usize, ClearError> {
        let mut st = self.state.lock();
        let keys: Vec<BlockKey> = st
            .index
            .iter()
            .filter(|(_, e)| e.state == EntryState::Ready && e.namespace == namespace)
            .map(|(&key, _)| key)
            .collect();
        keys.iter().for_each(|&key| st.retire(key, false));
        Ok(keys.len())
    }

    fn pins(&self) -> Vec<(EntryRef, u32)> {
        let st = self.state.lock();
        let ready = st
            .index
            .iter()
            .filter(|(_, e)| e.pins > 0)
            .map(|(&key, e)| (EntryRef { key, entry_id: e.id }, e.pins));
        let doomed = st.doomed.iter().map(|(&entry_id, d)| (EntryRef { key: d.key, entry_id }, d.pins));
        ready.chain(doomed).collect()
    }

    fn stats(&self) -> TierStats {
        let st = self.state.lock();
        TierStats {
            objects: st.index.len() as u64 - st.writing,
            pinned_objects: st.pinned_ready,
            doomed_objects: st.doomed.len() as u64,
            used_bytes: st.allocator.used_bytes(),
            capacity_bytes: st.allocator.capacity_bytes(),
            stored: st.counters.stored,
            evictions: st.counters.evictions,
            rejected: st.counters.rejected,
            checksum_failures: st.counters.checksum_failures,
        }
    }

    fn check_integrity(&self) -> Result<(), IntegrityError> {
        self.state.lock().check(&self.arena).map_err(|detail| integrity("dram", detail))
    }

    #[cfg(feature = "test-hooks")]
    fn corrupt_for_test(&self, key: BlockKey, payload_byte_offset: usize) -> bool {
        let st = self.state.lock();
        let Some(entry) = st.index.get(&key).filter(|e| e.state == EntryState::Ready) else { return false };
        if entry.pins > 0 || payload_byte_offset as u64 >= entry.payload_len {
            return false;
        }
        let offset = usize::try_from(entry.extent.offset).expect("arena offsets fit usize");
        // SAFETY: ready, unpinned, lock held: reads need a pin (taken under this lock), writers only
        // write entries still being written, and an indexed extent is never freed or reused.
        unsafe { self.arena.flip_bit(offset + payload_byte_offset, 0) };
        true
    }
}

/// Frees a put batch's writing entries if its copy panics, so a failed put leaks no space and
/// leaves no key "being written" forever.
struct AbandonOnPanic<'a> {
    tier: &'a DramTier,
    keys: &'a [BlockKey],
    jobs: &'a [WriteJob],
    armed: bool,
}

impl Drop for AbandonOnPanic<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut st = self.tier.state.lock();
        for job in self.jobs {
            let key = self.keys[job.item];
            // A key is written by at most one batch at a time, so a writing entry here is ours.
            if st.index.get(&key).is_some_and(|e| e.state == EntryState::Writing) {
                let entry = st.index.remove(&key).expect("entry just seen");
                st.allocator.free(entry.extent);
                st.writing -= 1;
            }
        }
    }
}

impl std::fmt::Debug for DramTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DramTier").field("arena", &self.arena).field("workers", &self.workers).finish()
    }
}
