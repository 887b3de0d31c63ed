//! kvtier-transfer: the data-plane engine between the store's tiers and an engine's paged KV
//! pool (DESIGN §4).
//!
//! - [`TransferEngine`]: asynchronous load and store jobs. `submit_load(keys, pool, block_ids)`
//!   and `submit_store` return a [`JobId`]; [`finished`](TransferEngine::finished) and
//!   [`wait`](TransferEngine::wait) collect jobs with a [`BlockOutcome`] per block;
//!   [`wait_layer`](TransferEngine::wait_layer) lets an engine compute layer N while later
//!   layers land; [`cancel`](TransferEngine::cancel). A load leases its hit prefix at submission
//!   and releases it when the job finishes.
//! - Paged jobs ([`submit_paged_load`](TransferEngine::submit_paged_load),
//!   [`submit_paged_store`](TransferEngine::submit_paged_store)): the same jobs into or from an
//!   engine's `kvtier_core::paged::PagedPool`, each one store call (`Store::load_into_pool` /
//!   `Store::put_from_pool`: one copy per DRAM block) on the store workers.
//! - The chunked pipeline (ShadowServe §4.2–4.3): read (store) → decompress → dequantize →
//!   scatter (into the `LayerFirst` pool), each stage on its own workers, split by
//!   [`StageWorkers::balanced`] from measured stage rates. Stage buffers are allocated once;
//!   each chunk in flight owns one region; a job larger than the buffers runs in rounds.
//! - [`duplex`]: the DuplexKV swap engine (SuperInfer §4.3.2), over a host pool or, through
//!   [`cuda`] (the CUDA runtime loaded at run time), a pool in GPU memory.
//!
//! ```
//! use std::sync::Arc;
//! use kvtier_core::{block_keys, Dtype, Geometry, Namespace};
//! use kvtier_store::{DramStoreConfig, Store, StoreConfig};
//! use kvtier_transfer::{BlockOutcome, PoolBuffer, PoolRef, TransferConfig, TransferEngine};
//!
//! let geometry = Geometry::new(2, 2, 64, Dtype::F16, 16, vec![]).unwrap();
//! let namespace = Namespace { model_id: "demo".into(), geometry, layout_version: 1,
//!                             cache_salt: String::new(), rank: 0 };
//! let config = StoreConfig { dram: DramStoreConfig::new(1 << 20), ..StoreConfig::default() };
//! let store = Arc::new(Store::new(namespace, config).unwrap());
//! let keys = block_keys(store.namespace_hash(), &(0..64).collect::<Vec<u32>>(), 16, &[]).unwrap();
//! let engine = TransferEngine::new(store.clone(), TransferConfig::default()).unwrap();
//!
//! // Store pool blocks 0..4 under the keys, then load them into blocks 4..8.
//! let pool = PoolBuffer::new(8 * store.block_bytes());
//! let put = engine.submit_store(&keys, PoolRef::owned(&pool, 8), &[0, 1, 2, 3]).unwrap();
//! engine.wait(&[put]).unwrap();
//! let job = engine.submit_load(&keys, PoolRef::owned(&pool, 8), &[4, 5, 6, 7]).unwrap();
//! engine.wait_layer(job, 0).unwrap(); // layer 0 of every block is in place
//! let done = engine.wait(&[job]).unwrap().remove(0);
//! assert!(done.outcomes.iter().all(|&o| o == BlockOutcome::Done));
//! ```
//!
//! Invariants:
//! - Every block of a job ends with exactly one outcome; only `Done` blocks hold their bytes.
//!   A failed block (miss, checksum, decode, bad id, cancel, worker panic) is reported, never
//!   silent garbage.
//! - A panic on a worker fails its chunk's blocks (`Panicked`), never the thread or the job:
//!   `wait`, `wait_layer` (which then errors) and drop return (`src/panics.rs`).
//! - No allocation on the load hot path (stage workers processing a chunk), outside the store's
//!   own calls: `tests/no_allocation_on_hot_path.rs` proves it with a counting allocator.
//! - Bounded: `jobs_in_flight_max` jobs (submitted, not collected), `inflight_bytes_max`
//!   bytes of unfinished jobs, `job_blocks_max` blocks per job, `buffer_chunks` chunks in
//!   flight (every stage queue holds at most that many).
//! - A job never writes a pool block outside its `block_ids`, and writes each at most once.
//! - A pool block has one load or any number of stores holding it (submitted, not collected),
//!   never both: a submission that would race one is refused, naming the block and the job
//!   (`BlockInUse`; `submission.rs`, `tests/it/racing_jobs_are_refused.rs`); memory a held pool
//!   covers is not used laid out otherwise (another view, another block count) by a job when
//!   either loads (`PoolShapeInUse`).

mod aligned;
mod codec;
pub mod config;
pub mod cuda;
pub mod duplex;
mod duplex_queue;
mod engine;
mod error;
pub mod hot_path;
mod job;
mod panics;
mod pool;
#[cfg(feature = "bench-baselines")]
mod sequential;
mod stages;
mod store_calls;
mod submission;

pub use config::{StageWorkers, TransferConfig, STAGE_NAMES};
pub use duplex::{BlockState, DuplexConfig, DuplexEngine, StepTickets};
pub use engine::{StageStats, StoreHandle, TransferEngine};
pub use error::TransferError;
pub use job::{BlockOutcome, FinishedJob, JobId, JobKind};
pub use kvtier_codec::streams::Backend;
#[cfg(feature = "test-hooks")]
pub use panics::PanicSite;
pub use pool::{PoolBuffer, PoolRef};
