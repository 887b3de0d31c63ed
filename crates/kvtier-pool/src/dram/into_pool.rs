//! DRAM objects straight into an engine's paged pool: one copy, layer by layer.
//!
//! A load through a staging object copies every byte twice (arena → object → pool). Here each
//! object's pieces go from the arena directly to the pool block's regions ([`PagedPool`]), all
//! objects' layer 0 first, then layer 1, ..., so the engine may start on layer `l` once
//! `layer_done(l)` is called (Strata §4.1, the unified-pool paper's layerwise loads). Small layers
//! go a few at a time (each task copies at least [`TASK_BYTES_MIN`] of an object).
//!
//! Verification: each object's checksum covers its whole payload, and its pieces arrive over
//! every layer, so each object carries a running XXH3 state fed piece by piece as the pieces are
//! copied (the fused copy+hash of [`copy_hashing`], no second pass). The verdict comes after the
//! last layer: a block whose object fails it is reported `Corrupt` (doomed and counted as by
//! [`Tier::read_pinned`](crate::tier::Tier::read_pinned)), and its pool block must not be used.
//! Its layers were already announced, so a caller that computes on layer `l` before the verdict
//! must drop what it computed from a failed block (vLLM does: a step whose blocks failed to load
//! is discarded and those blocks are recomputed). A header that does not name the key, the
//! namespace and the pool's block size fails before anything is copied.

use kvtier_core::checksum::{copy_hashing, Xxh3};
use kvtier_core::copy;
use kvtier_core::paged::PagedPool;
use kvtier_core::ObjectHeader;
use parking_lot::Mutex;

use super::state::PinnedAt;
use super::{DramTier, HEADER};
use crate::tier::{EntryRef, ReadOutcome};

/// Bytes of one object one task copies at least. One layer per task is 64 KiB of a Llama-3-8B
/// block: 512 blocks into a pool then took 134-147 ms of CPU per GiB against 125-129 ms with four
/// layers (256 KiB) per task (process CPU time, median of 7, on the 2-core development VM; the
/// plain `load` of the same bytes 104-110 ms).
const TASK_BYTES_MIN: usize = 256 << 10;

/// Layers each task copies per object: enough for [`TASK_BYTES_MIN`], at least one. Layers are
/// still announced in order, each once every object's copy of it is in place (a group's layers
/// together, after the group: at most `TASK_BYTES_MIN` of each object later than one by one).
fn layers_per_task(object_bytes: usize, layers: usize) -> usize {
    let per_layer = (object_bytes / layers.max(1)).max(1);
    TASK_BYTES_MIN.div_ceil(per_layer).clamp(1, layers.max(1))
}

struct PoolJob {
    item: usize,
    block: usize,
    offset: usize,
    expected: u64,
    hasher: Mutex<Xxh3>,
}

impl DramTier {
    /// Reads pinned `entries[i]` into pool block `block_ids[i]`, layer by layer, calling
    /// `layer_done(l)` once every entry's layer `l` is in place (after a fence: another thread
    /// told of it sees the bytes). `outcomes[i]` says how entry `i` went once the call returns
    /// (see the module docs: `Loaded` only if its whole object verified).
    ///
    /// Panics (a caller bug) if the lengths differ, a block id is out of range or repeated, or a
    /// pinned object is not `pool.block_bytes()` long.
    pub fn read_pinned_into_pool(
        &self,
        namespace: u128,
        entries: &[EntryRef],
        pool: &PagedPool,
        block_ids: &[usize],
        outcomes: &mut [ReadOutcome],
        layer_done: &mut dyn FnMut(usize),
    ) {
        assert!(entries.len() == block_ids.len() && block_ids.len() == outcomes.len(), "one block per entry");
        let ids: Vec<u64> = block_ids.iter().map(|&b| b as u64).collect();
        pool.check_block_ids(&ids).expect("distinct block ids inside the pool");
        let mut jobs = Vec::with_capacity(entries.len());
        let mut corrupt = Vec::new();
        {
            let st = self.state.lock();
            for (item, entry) in entries.iter().enumerate() {
                let (extent, payload_len) = match st.find_pinned(entry) {
                    Some(PinnedAt::Ready(extent, len) | PinnedAt::Doomed(extent, len, false)) => {
                        (extent, len)
                    }
                    Some(PinnedAt::Doomed(_, _, true)) => {
                        outcomes[item] = ReadOutcome::CorruptKnown;
                        continue;
                    }
                    None => {
                        outcomes[item] = ReadOutcome::NotPinned;
                        continue;
                    }
                };
                assert_eq!(payload_len, pool.block_bytes() as u64, "object {item} is not one pool block");
                let offset = usize::try_from(extent.offset).expect("arena offsets fit usize");
                jobs.push(PoolJob {
                    item,
                    block: block_ids[item],
                    offset,
                    expected: 0,
                    hasher: Mutex::new(Xxh3::new()),
                });
            }
        }
        let len = pool.block_bytes();
        jobs.retain_mut(|job| {
            // SAFETY: the entry is pinned, so its extent is neither freed nor rewritten meanwhile.
            let header_bytes = unsafe { self.arena.bytes(job.offset + len, HEADER) };
            let header = ObjectHeader::decode(header_bytes).ok().filter(|h| {
                h.expect_identity(namespace, entries[job.item].key).is_ok() && h.payload_len == len as u64
            });
            match header {
                Some(h) => {
                    job.expected = h.payload_checksum;
                    true
                }
                None => {
                    outcomes[job.item] = ReadOutcome::Corrupt;
                    corrupt.push(job.item);
                    false
                }
            }
        });
        let layers = pool.num_layers();
        let group = layers_per_task(len, layers);
        for first in (0..layers).step_by(group) {
            let last = (first + group).min(layers);
            let group_bytes: usize =
                (first..last).flat_map(|l| pool.layer_pieces(l)).map(|(_, _, l)| l).sum();
            self.workers.for_each(&jobs, group_bytes * jobs.len(), |job| {
                let mut hasher = job.hasher.lock();
                for (region, off, piece_len) in (first..last).flat_map(|l| pool.layer_pieces(l)) {
                    // SAFETY: the entry is pinned (extent stable, nobody writes it); `off +
                    // piece_len <= len` because the regions tile the object; the block id was
                    // checked in range and distinct, so this worker alone writes this piece, and
                    // the pool's builder promised exclusive access to its buffers.
                    unsafe {
                        let src = self.arena.bytes(job.offset + off, piece_len);
                        copy_hashing(pool.piece(region, job.block), src, &mut hasher);
                    }
                }
                copy::fence();
            });
            (first..last).for_each(&mut *layer_done);
        }
        for job in &jobs {
            let ok = job.hasher.lock().digest() == job.expected;
            outcomes[job.item] = if ok { ReadOutcome::Loaded } else { ReadOutcome::Corrupt };
            if !ok {
                corrupt.push(job.item);
            }
        }
        self.settle_corrupt(entries, &corrupt, outcomes);
    }
}

#[cfg(test)]
mod tests {
    use super::layers_per_task;

    #[test]
    fn tasks_copy_at_least_256_kib_of_an_object_and_never_more_layers_than_it_has() {
        assert_eq!(layers_per_task(2 << 20, 32), 4); // Llama-3-8B: 64 KiB per layer
        assert_eq!(layers_per_task(64 << 20, 32), 1); // 2 MiB per layer: one layer a task
        assert_eq!(layers_per_task(3 << 10, 3), 3); // tiny blocks: every layer in one task
        assert_eq!(layers_per_task(1 << 20, 7), 2); // 146 KiB per layer: two make 256 KiB
        assert_eq!(layers_per_task(0, 0), 1);
    }
}
