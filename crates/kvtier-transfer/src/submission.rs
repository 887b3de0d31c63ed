//! What a submission must satisfy before the engine takes it: a pool of the right size, one block
//! id per key, a bounded job ([`check_sizes`]); and no race with a job in flight on the same pool
//! blocks ([`BlockClaims`]).
//!
//! Claims (docs/transfer.md §1, "Jobs on the same blocks"): a load writes its target blocks, a store reads its source
//! blocks. So a pool block may have one load or any number of stores in flight, never both: a
//! submission that would break that is refused with [`TransferError::BlockInUse`], naming the
//! block and the job holding it, and nothing starts. A job holds its blocks from its submission
//! until it is collected ([`finished`](crate::TransferEngine::finished) /
//! [`wait`](crate::TransferEngine::wait)): the caller learns that the job stopped touching the
//! pool only then, so only then may it hand a block on. Ids out of the pool's range hold nothing
//! (they settle as `BadBlockId`).
//!
//! A pool is known by its memory: a [`PoolRef`]'s base pointer, a [`PagedPool`]'s first region's
//! base (two paged pools built over the same engine tensors share it, whatever their other
//! regions); block `b` of either is the same key. That holds only for the same layout: another view
//! of the same bytes (an offset slice, a paged pool over a plain one) or the same memory with
//! another block count (a `LayerFirst` pool puts layer `l` of block `b` at
//! `((2l + kv) × num_blocks + b) × segment`) has other bytes under block `b`. So each held pool's
//! memory is kept too ([`PoolMemory`]: its spans and block count), and a job whose pool overlaps a
//! held pool laid out otherwise is refused when either job loads ([`TransferError::PoolShapeInUse`],
//! naming the job); two stores only read, and may share bytes. A pool with no address (none is built
//! outside the engine) holds nothing. Cost: one hash-map entry per block of a job, touched at
//! submission and at collection, and one comparison per held pool at submission; nothing per chunk.

use std::collections::HashMap;

use kvtier_core::paged::PagedPool;

use crate::error::TransferError;
use crate::job::{Job, JobId, JobKind};
use crate::pool::PoolRef;

/// Checks a pool of `num_blocks` blocks of `len` bytes in all, and the counts.
pub(crate) fn check_sizes(
    block_bytes: usize,
    job_blocks_max: usize,
    keys: usize,
    len: usize,
    num_blocks: u64,
    block_ids: &[u64],
) -> Result<(), TransferError> {
    let bb = block_bytes as u64;
    let expected = num_blocks.saturating_mul(bb);
    if num_blocks == 0 || len as u64 != expected {
        return Err(TransferError::PoolSize { actual: len, expected, num_blocks, block_bytes: bb });
    }
    if keys != block_ids.len() {
        return Err(TransferError::CountMismatch { keys, block_ids: block_ids.len() });
    }
    if keys > job_blocks_max {
        return Err(TransferError::JobTooLarge { blocks: keys, max: job_blocks_max });
    }
    Ok(())
}

/// The address that names a pool (0: none).
pub(crate) fn pool_address(pool: &PoolRef, paged: Option<&PagedPool>) -> usize {
    paged.map_or(pool.ptr() as usize, |p| p.base_address())
}

/// A pool as memory: the `(start, len)` of each span it covers, and its block count. Two pools
/// with equal memory are one pool (block `b` is the same bytes in both); overlapping but unequal
/// ones put other bytes under the same ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PoolMemory {
    spans: Vec<(usize, usize)>,
    num_blocks: u64,
}

impl PoolMemory {
    pub(crate) fn of(pool: &PoolRef, paged: Option<&PagedPool>) -> Self {
        let spans = match paged {
            Some(p) => p.spans().collect(),
            None => vec![(pool.ptr() as usize, pool.len())],
        };
        PoolMemory { spans, num_blocks: pool.num_blocks() }
    }

    fn overlaps(&self, other: &PoolMemory) -> bool {
        let hit = |&(a, la): &(usize, usize), &(b, lb): &(usize, usize)| {
            la > 0 && lb > 0 && a < b.saturating_add(lb) && b < a.saturating_add(la)
        };
        self.spans.iter().any(|r| other.spans.iter().any(|o| hit(r, o)))
    }
}

/// A pool jobs in flight hold blocks of: its memory, and those jobs (with their kinds).
struct HeldPool {
    memory: PoolMemory,
    jobs: Vec<(JobId, JobKind)>,
}

/// Jobs in flight on one pool block.
#[derive(Default)]
struct Claim {
    load: Option<JobId>,
    stores: Vec<JobId>,
}

/// Every block held by a job submitted and not yet collected, by (pool address, block id), and
/// each held pool's memory, by address (module docs).
#[derive(Default)]
pub(crate) struct BlockClaims {
    blocks: HashMap<(usize, u64), Claim>,
    pools: HashMap<usize, HeldPool>,
}

fn kind_name(kind: JobKind) -> &'static str {
    match kind {
        JobKind::Load => "load",
        JobKind::Store => "store",
    }
}

impl BlockClaims {
    /// Refuses a `kind` job on `block_ids` of the pool at `address` (of `memory`) that would race
    /// a held claim: a pool overlapping a held one laid out otherwise when either job loads; on
    /// the same pool, a load on a block with any job, a store on a block being loaded.
    pub(crate) fn check(
        &self,
        kind: JobKind,
        address: usize,
        memory: &PoolMemory,
        block_ids: &[u64],
    ) -> Result<(), TransferError> {
        let num_blocks = memory.num_blocks;
        let holds_any = address != 0 && block_ids.iter().any(|&b| b < num_blocks);
        let clash = self
            .pools
            .values()
            .filter(|held| holds_any && held.memory != *memory && held.memory.overlaps(memory))
            .flat_map(|held| held.jobs.iter().map(move |&(job, held_kind)| (job, held_kind, held)))
            .filter(|&(_, held_kind, _)| kind == JobKind::Load || held_kind == JobKind::Load)
            .min_by_key(|&(job, _, _)| job);
        if let Some((job, held_kind, held)) = clash {
            return Err(TransferError::PoolShapeInUse {
                kind: kind_name(kind),
                job,
                held_kind: kind_name(held_kind),
                num_blocks,
                held_num_blocks: held.memory.num_blocks,
            });
        }
        for &block in block_ids.iter().filter(|&&b| address != 0 && b < num_blocks) {
            let Some(claim) = self.blocks.get(&(address, block)) else { continue };
            let held = match (kind, claim.load, claim.stores.first()) {
                (_, Some(load), _) => Some((load, JobKind::Load)),
                (JobKind::Load, None, Some(&store)) => Some((store, JobKind::Store)),
                _ => None,
            };
            if let Some((job, held_kind)) = held {
                let (kind, held_kind) = (kind_name(kind), kind_name(held_kind));
                return Err(TransferError::BlockInUse { block, kind, job, held_kind });
            }
        }
        Ok(())
    }

    /// Records `job`'s blocks, and its pool's `memory` (what [`check`](Self::check) passed
    /// with, under the same lock).
    pub(crate) fn hold(&mut self, job: &Job, memory: PoolMemory) {
        let address = pool_address(&job.pool, job.paged.as_ref());
        let num_blocks = job.pool.num_blocks();
        if address != 0 && job.block_ids.iter().any(|&b| b < num_blocks) {
            let held = self.pools.entry(address).or_insert_with(|| HeldPool { memory, jobs: Vec::new() });
            held.jobs.push((job.id, job.kind));
        }
        for &block in job.block_ids.iter().filter(|&&b| address != 0 && b < job.pool.num_blocks()) {
            let claim = self.blocks.entry((address, block)).or_default();
            match job.kind {
                JobKind::Load => claim.load = Some(job.id),
                JobKind::Store => claim.stores.push(job.id),
            }
        }
    }

    /// Releases what [`hold`](Self::hold) recorded for `job` (it is being collected).
    pub(crate) fn release(&mut self, job: &Job) {
        let address = pool_address(&job.pool, job.paged.as_ref());
        if let Some(held) = self.pools.get_mut(&address) {
            held.jobs.retain(|&(j, _)| j != job.id);
            if held.jobs.is_empty() {
                self.pools.remove(&address);
            }
        }
        for &block in job.block_ids.iter().filter(|&&b| address != 0 && b < job.pool.num_blocks()) {
            let Some(claim) = self.blocks.get_mut(&(address, block)) else { continue };
            match job.kind {
                JobKind::Load if claim.load == Some(job.id) => claim.load = None,
                JobKind::Load => {}
                JobKind::Store => {
                    if let Some(i) = claim.stores.iter().position(|&s| s == job.id) {
                        claim.stores.swap_remove(i);
                    }
                }
            }
            if claim.load.is_none() && claim.stores.is_empty() {
                self.blocks.remove(&(address, block));
            }
        }
    }
}
