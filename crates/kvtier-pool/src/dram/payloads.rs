//! What a DRAM put copies from: the caller's payload slices, or blocks of an engine's paged pool
//! (gathered piece by piece straight into the object's extent, hashed on the way).
//!
//! Pool blocks are copied in ascending block id order whatever the batch's key order, up to
//! [`RUN_MAX`] blocks per task region by region, two blocks' pieces at a time through one loop
//! ([`Xxh3::update_copying_pair`]): a pool object is 64 pieces of 32 KiB in 64 regions
//! (Llama-3-8B), and what a put from the pool pays over a put from contiguous objects is the
//! start of each scattered 32 KiB read, which two reads in flight at once half hide
//! (docs/benchmarks.md "Copy and hash in one loop"). Ascending order reads every region of the
//! pool upwards, consecutive blocks in one stretch.

use kvtier_core::checksum::{copy_hashing, copy_with_checksum, Xxh3};
use kvtier_core::paged::PagedPool;

/// Pool blocks one task copies together at most (8 MiB of Llama-3-8B blocks).
pub(super) const RUN_MAX: usize = 4;

/// One object of a put: payload item `item` into the extent at arena `offset`.
pub(super) struct WriteJob {
    pub(super) item: usize,
    pub(super) offset: usize,
    pub(super) extent_len: usize,
}

/// What a put copies from: the caller's payload slices, or blocks of an engine's paged pool.
pub(super) enum Payloads<'a> {
    Slices(&'a [&'a [u8]]),
    Pool { pool: &'a PagedPool, blocks: &'a [usize] },
}

impl Payloads<'_> {
    pub(super) fn len(&self) -> usize {
        match self {
            Payloads::Slices(s) => s.len(),
            Payloads::Pool { blocks, .. } => blocks.len(),
        }
    }

    pub(super) fn payload_len(&self, item: usize) -> usize {
        match self {
            Payloads::Slices(s) => s[item].len(),
            Payloads::Pool { pool, .. } => pool.block_bytes(),
        }
    }

    /// The tasks to copy `jobs` in (publication keeps the batch's order, which the eviction
    /// policy sees): one job each from slices; from a pool, the jobs by ascending block id in
    /// runs of up to [`RUN_MAX`] (see the module docs).
    pub(super) fn copy_runs<'j>(&self, jobs: &'j [WriteJob]) -> Vec<Vec<&'j WriteJob>> {
        let Payloads::Pool { blocks, .. } = self else {
            return jobs.iter().map(|job| vec![job]).collect();
        };
        let mut order: Vec<&WriteJob> = jobs.iter().collect();
        order.sort_by_key(|job| blocks[job.item]);
        order.chunks(RUN_MAX).map(<[&WriteJob]>::to_vec).collect()
    }

    /// Copies items `items[i]` into `dsts[i]` (each its payload length); returns their
    /// checksums. A pool run goes piece by piece, each region across the run's blocks (one
    /// upward read of the region when the blocks are consecutive), two blocks through one loop.
    /// Fences.
    pub(super) fn copy_run(&self, items: &[usize], dsts: &mut [&mut [u8]]) -> Vec<u64> {
        assert_eq!(items.len(), dsts.len(), "one destination per item");
        let (pool, blocks) = match self {
            Payloads::Slices(s) => {
                return items.iter().zip(dsts).map(|(&i, dst)| copy_with_checksum(dst, s[i])).collect()
            }
            Payloads::Pool { pool, blocks } => (pool, blocks),
        };
        let mut hashers: Vec<Xxh3> = items.iter().map(|_| Xxh3::new()).collect();
        for dst in dsts.iter() {
            assert_eq!(dst.len(), pool.block_bytes(), "a pool block fills its object");
        }
        for layer in 0..pool.num_layers() {
            for (region, off, len) in pool.layer_pieces(layer) {
                // SAFETY: the block id was checked in range by `put_from_pool`, so the piece lies
                // inside its region, which the pool's builder promised live; the caller does not
                // write blocks being stored.
                let piece = |item: usize| unsafe {
                    std::slice::from_raw_parts(pool.piece(region, blocks[item]), len)
                };
                let mut parts = items.iter().zip(dsts.iter_mut()).zip(&mut hashers);
                while let Some(((&item, dst), hasher)) = parts.next() {
                    // `dst` is this item's own extent, `off + len <= block_bytes` (regions tile
                    // the object), so each destination below is in bounds and its own.
                    let dst = dst[off..off + len].as_mut_ptr();
                    match parts.next() {
                        // SAFETY: as above, for both items.
                        Some(((&other, other_dst), other_hasher)) => unsafe {
                            let other_dst = other_dst[off..off + len].as_mut_ptr();
                            Xxh3::update_copying_pair(
                                (hasher, dst, piece(item)),
                                (other_hasher, other_dst, piece(other)),
                            )
                        },
                        // SAFETY: as above.
                        None => unsafe { copy_hashing(dst, piece(item), hasher) },
                    }
                }
            }
        }
        kvtier_core::copy::fence();
        hashers.iter().map(|h| h.digest()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_runs_are_ascending_blocks_of_at_most_run_max() {
        let mut buf = vec![0u8; 16 * 8];
        // SAFETY: `buf` outlives the pool, and nothing copies through it here.
        let pool = unsafe { PagedPool::from_regions(&[(buf.as_mut_ptr(), 8)], &[1], 16) }.unwrap();
        let blocks = [9, 2, 3, 8, 2, 7, 1, 4, 5, 6, 15];
        let jobs: Vec<WriteJob> =
            (0..blocks.len()).map(|item| WriteJob { item, offset: 0, extent_len: 0 }).collect();
        let runs = Payloads::Pool { pool: &pool, blocks: &blocks }.copy_runs(&jobs);
        let ids: Vec<Vec<usize>> = runs.iter().map(|r| r.iter().map(|j| blocks[j.item]).collect()).collect();
        // Sorted: 1 2 2 3 4 5 6 7 8 9 15, four at a time.
        assert_eq!(ids, [vec![1, 2, 2, 3], vec![4, 5, 6, 7], vec![8, 9, 15]]);
        let slices: Vec<&[u8]> = vec![&[1u8][..]; 3];
        let one_each = Payloads::Slices(&slices).copy_runs(&jobs[..3]);
        assert_eq!(one_each.iter().map(|r| r[0].item).collect::<Vec<_>>(), [0, 1, 2]);
    }
}
