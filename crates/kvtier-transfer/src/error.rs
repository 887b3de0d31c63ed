//! Errors of the transfer engine. A block that fails inside a job (miss, checksum failure,
//! decode failure, cancelled, bad id) is a per-block [`BlockOutcome`](crate::BlockOutcome),
//! not an error: errors are for a submission that cannot be run at all and for misuse.

use kvtier_core::LayoutError;
use kvtier_store::StoreError;
use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum TransferError {
    #[error("invalid transfer config: {0}")]
    Config(String),
    #[error("pool is {actual} bytes; expected {expected} ({num_blocks} blocks of {block_bytes} bytes, LayerFirst)")]
    PoolSize { actual: usize, expected: u64, num_blocks: u64, block_bytes: u64 },
    #[error("{keys} keys but {block_ids} block ids; expected one pool block per key")]
    CountMismatch { keys: usize, block_ids: usize },
    #[error("{active} jobs are in flight or finished but not collected; expected fewer than jobs_in_flight_max = {max} (collect them with finished() or wait())")]
    TooManyJobs { active: usize, max: usize },
    #[error(
        "job of {job_bytes} bytes with {inflight_bytes} bytes in flight exceeds inflight_bytes_max = {max}"
    )]
    TooManyBytes { job_bytes: u64, inflight_bytes: u64, max: u64 },
    #[error("job of {blocks} blocks; expected at most job_blocks_max = {max}")]
    JobTooLarge { blocks: usize, max: usize },
    #[error("job {id} is unknown: never submitted here, or already collected")]
    UnknownJob { id: u64 },
    #[error("job {id} is given twice; expected each job once (a job is reported once)")]
    RepeatedJob { id: u64 },
    /// A submission whose pool block an in-flight job (submitted, not collected) touches: a load
    /// writes its blocks, a store reads them (docs/transfer.md §1).
    #[error("pool block {block} is in use by {held_kind} job {job} (not collected yet); a {kind} on it would race that job")]
    BlockInUse { block: u64, kind: &'static str, job: u64, held_kind: &'static str },
    /// A submission whose pool shares memory with an in-flight job's pool laid out otherwise
    /// (another view of its bytes, or another block count) when either job loads: the same block
    /// ids would name other bytes (docs/transfer.md §1).
    #[error("the {kind} job's pool shares memory with the pool of {held_kind} job {job} (not collected yet), laid out otherwise ({num_blocks} blocks here, {held_num_blocks} there, or another view of its bytes), so the same block ids name other bytes and the jobs would race; expected that same pool, or memory of its own, until job {job} is collected")]
    PoolShapeInUse {
        kind: &'static str,
        job: u64,
        held_kind: &'static str,
        num_blocks: u64,
        held_num_blocks: u64,
    },
    #[error("layer {layer} is out of range; the geometry has {num_layers} layers")]
    LayerOutOfRange { layer: u32, num_layers: u32 },
    #[error("job {id}: a transfer worker panicked ({message}); its blocks that had not finished are `panicked`, so no layer of it is complete")]
    WorkerPanicked { id: u64, message: String },
    #[error("the engine is shutting down")]
    ShuttingDown,
    #[error("duplex: {0}")]
    Duplex(String),
    #[error("device: {0}")]
    Device(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A paged pool the job cannot use (e.g. layers that are not the geometry's).
    #[error(transparent)]
    Layout(#[from] LayoutError),
}
